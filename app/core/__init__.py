"""The serving core: what a model file is and how each tokenizer library encodes it. No HTTP here."""
