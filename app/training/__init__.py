"""How the bundled drafts and the tiny family are made."""
