"""linstream model core: recurrent LMs, their session state, tokenizer, sampling and generation."""
