"""Text in and out of a model: the tokenizer (from a GGUF file or a Hugging Face folder) and the chat template,
rendered in a sandbox."""
