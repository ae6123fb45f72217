"""Drafters: the block drafter, the MTP (next-n) chain and n-gram lookup."""

KINDS = ("block", "mtp", "ngram")  # the drafter kinds a replica can host (`--drafter`, per request)
