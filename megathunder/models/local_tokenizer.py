"""A small byte-level BPE tokenizer with the ChatML and tool-call tokens, trained locally.

For tests and benchmarks that need a *real* tokenizer without a hub download: it encodes any text
(byte-level), has ``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ``</tool_call>`` as single
tokens like Qwen's, and trains in well under a second. Not a model's tokenizer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

from megathunder.rollout.chat import SPECIAL_TOKENS

_CORPUS = [
    "What is 17 + 25? Answer with a number. The answer is 42.",
    "You are a helpful assistant. Use the tools to solve the task, then give the final answer.",
    '{"name": "bash", "arguments": {"command": "python -m unittest -q"}}',
    '{"name": "read_file", "arguments": {"path": "calc/ops.py"}}',
    '{"name": "str_replace", "arguments": {"path": "src/mod.py", "old": "a - b", "new": "a + b"}}',
    '{"name": "calculator", "arguments": {"expression": "(12 * 7) + 3"}}',
    "def add(a, b):\n    return a + b\n\n\nclass TestAdd(unittest.TestCase):\n    def test_add(self):\n"
    "        self.assertEqual(add(2, 3), 5)\n",
    'Traceback (most recent call last):\n  File "test.py", line 3, in <module>\nAssertionError',
    "error: command timed out after 10 seconds; exit code 137; Ran 3 tests in 0.001s OK FAILED",
    "ls -la && cat data.txt | wc -l > out/result.txt; mkdir -p out; mv a.log b.txt; echo done",
]


def train_byte_level_bpe(corpus: Iterable[str], vocab_size: int, special_tokens: Sequence[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus`` (``vocab_size`` includes the
    special tokens, which are never split). Shared by this module and ``models.tiny_hf``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


@functools.lru_cache(maxsize=4)
def train_local_chatml_tokenizer(vocab_size: int = 512):
    """A ``tokenizers.Tokenizer`` (byte-level BPE, ``vocab_size`` including the special tokens)."""
    return train_byte_level_bpe(_CORPUS * 4, vocab_size, SPECIAL_TOKENS)
