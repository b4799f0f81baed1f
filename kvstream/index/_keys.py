"""The per-block keys that make two blocks of the same tokens different (vLLM's `extra_keys`).

vLLM hashes a block from its parent, its tokens and a tuple of *extra keys*
(`vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`), and
puts that tuple, per block, in `BlockStored.extra_keys`. In that order:

1. the LoRA adapter's name, on every block of a LoRA request;
2. for each multimodal input overlapping the block, `(identifier, offset -
   block_start)`: the input's identifier (its content hash) and where it
   starts relative to the block (negative when it began in an earlier block);
3. the request's `cache_salt`, on block 0 only;
4. the prompt-embedding hash of the block's range (sha256 of the block's rows
   of `prompt_embeds`), when the prompt was given as embeddings.

A block with none of these has `None`. `vllm_extra_keys()` builds that
list for a prompt, so a router can query the index with exactly the keys the
engine used. The index itself keeps the adapter apart from the other keys
(`split_lora()`): a query with `lora_name` alone matches vLLM's LoRA
blocks, whose extra keys repeat the adapter's name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstream.errors import ConfigError

__all__ = ["MultimodalInput", "split_lora", "vllm_extra_keys"]

#: `(identifier, offset, length)`: a multimodal input of the prompt, its
#: placeholder tokens starting at token `offset`.
MultimodalInput = tuple[str, int, int]


def vllm_extra_keys(
    num_tokens: int,
    block_size: int,
    *,
    lora_name: str | None = None,
    mm_inputs: Sequence[MultimodalInput] = (),
    cache_salt: str | None = None,
    prompt_embeds_hashes: Sequence[bytes] | None = None,
) -> list[list[Any] | None]:
    """The `extra_keys` vLLM attaches to each full block of a prompt of `num_tokens`.

    `mm_inputs` are sorted by offset, as vLLM keeps them.
    `prompt_embeds_hashes` gives one digest per full block (vLLM's
    `sha256` of the block's embedding rows). The result has one entry per
    full block: a list, or None where vLLM sends None.
    """
    if type(num_tokens) is not int or num_tokens < 0:
        raise ConfigError(f"num_tokens: expected an int >= 0, got {num_tokens!r}")
    if type(block_size) is not int or block_size <= 0:
        raise ConfigError(f"block_size: expected a positive int, got {block_size!r}")
    n = num_tokens // block_size
    if prompt_embeds_hashes is not None and len(prompt_embeds_hashes) < n:
        raise ConfigError(
            f"prompt_embeds_hashes: expected one digest per full block ({n}), "
            f"got {len(prompt_embeds_hashes)}"
        )
    last = 0
    for i, item in enumerate(mm_inputs):
        if len(item) != 3 or item[1] < last or item[2] <= 0:
            raise ConfigError(
                f"mm_inputs[{i}]: expected (identifier, offset, length > 0) sorted by "
                f"offset, got {item!r:.80}"
            )
        last = item[1]
    out: list[list[Any] | None] = []
    mm = 0
    for k in range(n):
        start = k * block_size
        end = start + block_size
        keys: list[Any] = []
        if lora_name:
            keys.append(lora_name)
        # Multimodal inputs overlapping [start, end), as vLLM walks them.
        while mm < len(mm_inputs):
            identifier, offset, length = mm_inputs[mm]
            if end <= offset:
                break  # not reached yet
            if start >= offset + length:
                mm += 1  # passed
                continue
            keys.append([identifier, offset - start])
            if end >= offset + length:
                mm += 1  # ends here; the next may start in this block too
            else:
                break
        if k == 0 and cache_salt:
            keys.append(cache_salt)
        if prompt_embeds_hashes is not None:
            keys.append(prompt_embeds_hashes[k])
        out.append(keys or None)
    return out


def split_lora(lora_name: str | None, extra: Sequence[Any] | None) -> Sequence[Any] | None:
    """A block's extra keys without the adapter name vLLM repeats at their head.

    `None` when nothing else is left, so that `(lora_name, None)` and vLLM's
    `(lora_name, [lora_name])` name the same block.
    """
    if extra is None:
        return None
    if lora_name is not None and extra and extra[0] == lora_name:
        extra = extra[1:]
    return extra if extra else None
