"""qkv inside other libraries' models: ``qkv.integrations.transformers`` (Hugging Face).

Each integration imports its library lazily, so ``import qkv`` never needs it.
"""
