"""Corpus, tokenizers and the sharded, prefetching batch loader."""
