"""Evaluation: perplexity, routing statistics (H_norm), zero-shot tasks and the lm-eval
adapter (the phonebook's exact match lives in moremoe.phonebook.score)."""
