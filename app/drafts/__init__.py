"""Where drafts come from: the Proposer implementations, the feature head, cross-tokenizer drafts and
the typed draft spec."""
