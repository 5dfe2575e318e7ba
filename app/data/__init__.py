"""The text the bundled models are trained and measured on: corpus files, held-out splits, instructions."""
