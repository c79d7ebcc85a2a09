"""The chat tokenizer the SFT tests build: a tiny BPE tokenizer (`tiny_hf_model.make_tokenizer`) with ChatML's
two special tokens and template, and the answer words they draw from."""

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "zebra apple river stone cloud maple ember quiet lantern orbit velvet meadow".split()


def save_chat_tokenizer(directory) -> None:
    """Saves the chat tokenizer (300 BPE ids and the two ChatML tokens) to `directory`."""
    from megatron_csbp.tools.tiny_hf_model import make_tokenizer

    tokenizer = make_tokenizer(300)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
