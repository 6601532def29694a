"""Model access: named offline models and their loading, key roles and the hooks that capture them, windowed forward
passes, tokenizer identity."""
