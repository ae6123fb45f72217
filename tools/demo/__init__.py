"""The demo model's training: tokenizer, target, block drafter, MTP and EAGLE-3 drafters, and
their evaluation (`make demo-model`; docs/model.md). Not part of the served package."""
