"""Hugging Face model and tokenizer plumbing, free of megatron-core (and of rollout engines).

- arch.py        `arch_from_hf`: an HF config parsed once into `GPTArch` (builder, validation, fleet);
                 `ModelSpec`: the HF config and its `GPTArch`, as a run holds them
- presets.py     named model configs in HF keys (`tiny`), `tiny_config`, `resolve_hf_config`
- hub.py         where configs, tokenizers and checkpoints come from: a local path or a hub id
- tokenizers.py  `load_tokenizer`: a shipped tiny tokenizer by name, a directory or a hub id
- chat_templates.py  `model.chat_template`: an inline or file template replacing the tokenizer's, checked
- data/          the shipped tokenizer files (`tiny_word`, `tiny_char`, `tiny_bpe`)

Importing `arch`, `presets` or `hub` is cheap (no torch, transformers or huggingface_hub at import).
"""
