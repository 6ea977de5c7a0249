"""The reference's answer parser on device, on bytes: replies in, action indices out.

`reply_bytes` turns a reply's tokens into the parse text (`<think>`/`<answer>` prime + reply)
through a per-token byte table (`parse_byte_table`); `parse_bytes` is the reference's regex
(first `<think>(.*?)</think>\\s*<answer>(.*?)</answer>`, or `<answer>(.*?)</answer>` without
thinking), special strings removed, `||`-split, stripped, matched case-insensitively against
the env's action names -- vectorised over a batch of PAD-padded byte strings.

Deliberate differences from the reference:
- parsing is on bytes with ASCII semantics: whitespace is ` \\t\\n\\r\\v\\f` and `\\x1c-\\x1f`
  (Python's non-ASCII whitespace such as U+00A0 is not stripped), lower-casing maps A-Z only;
- special tokens the model writes (e.g. its end-of-turn token) are not part of the parsed text,
  as with a server that decodes with skip_special_tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from starpo import sampler as sampler_lib

# The reference removes these strings from the answer, in this order, before splitting.
SPECIAL_STRINGS = (b"<think>", b"</think>", b"<answer>", b"</answer>", b"<|im_start|>", b"<|im_end|>")
WHITESPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"
PAD = -1  # byte value of padding in byte strings (real bytes are 0..255)


def parse_byte_table(tokenizer, vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-token bytes for parsing: special tokens count as no text (skip_special_tokens).
    `vocab_size`: rows of the table (a model's embedding table may be larger than the
    tokenizer's vocabulary; ids without a token are no text)."""
    tb = padded_token_bytes(tokenizer, vocab_size)
    for i in tokenizer.hf.all_special_ids:
        if 0 <= i < len(tb):
            tb[i] = b""
    return sampler_lib.byte_table(tb)


def padded_token_bytes(tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """`tokenizer.token_bytes()`, padded with empty strings up to `vocab_size` ids."""
    tb = list(tokenizer.token_bytes())
    return tb + [b""] * max(0, (vocab_size or 0) - len(tb))


def reply_bytes(tokens, length, table, lengths, prime: bytes):
    """The parse text `prime + reply` as bytes [B, len(prime) + N*W] int32 (PAD after).

    tokens [B,N] int32, length [B]; table [V,W] uint8 right-aligned, lengths [V]."""
    B, N = tokens.shape
    W = table.shape[1]
    P = len(prime)
    L = P + N * W
    n = jnp.where(jnp.arange(N)[None] < length[:, None], lengths[tokens], 0)  # [B,N]
    start = P + jnp.cumsum(n, axis=1) - n
    byt = table[tokens].astype(jnp.int32)  # [B,N,W]
    w = jnp.arange(W)[None, None, :]
    keep = w >= W - n[..., None]
    dest = jnp.where(keep, start[..., None] + w - (W - n[..., None]), L)
    out = jnp.full((B, L), PAD, jnp.int32)
    if P:
        out = out.at[:, :P].set(jnp.asarray(np.frombuffer(prime, np.uint8), jnp.int32)[None])
    rows = jnp.broadcast_to(jnp.arange(B)[:, None, None], dest.shape)
    return out.at[rows, dest].set(byt, mode="drop")


def _windows(x, width: int):
    """[B,L,width]: x[b, p + i] at [b, p, i] (PAD beyond the end)."""
    L = x.shape[1]
    xp = jnp.pad(x, ((0, 0), (0, width)), constant_values=PAD)
    return jnp.stack([xp[:, i:i + L] for i in range(width)], axis=2)


def _pattern_table(patterns) -> tuple[np.ndarray, np.ndarray]:
    """(bytes [n, W] int32 padded with PAD, lengths [n]) of byte strings."""
    width = max(len(p) for p in patterns)
    table = np.full((len(patterns), width), PAD, np.int32)
    for i, p in enumerate(patterns):
        table[i, :len(p)] = np.frombuffer(p, np.uint8)
    return table, np.array([len(p) for p in patterns], np.int32)


def _matches(x, patterns):
    """bool[B,L,n]: pattern i starts at each position of x [B,L] (patterns: byte strings)."""
    table, lengths = _pattern_table(patterns)
    win = _windows(x, table.shape[1])  # [B,L,W]
    used = np.arange(table.shape[1])[None, :] < lengths[:, None]  # [n,W]
    eq = (win[:, :, None, :] == table[None, None]) | ~used[None, None]
    return jnp.all(eq, axis=3)


def _first(mask, default):
    return jnp.where(mask.any(axis=1), jnp.argmax(mask, axis=1), default).astype(jnp.int32)


def _at(x, idx, fill):
    L = x.shape[1]
    v = jnp.take_along_axis(x, jnp.clip(idx, 0, L - 1)[:, None], axis=1)[:, 0]
    return jnp.where((idx >= 0) & (idx < L), v, fill)


def _isspace(x):
    return jnp.any(x[..., None] == jnp.asarray(np.frombuffer(WHITESPACE, np.uint8), jnp.int32),
                   axis=-1)


def _compact(x, keep):
    """Move the kept entries of x [B,L] to the front (order kept), PAD after."""
    B, L = x.shape
    dest = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, L)
    return jnp.full((B, L), PAD, x.dtype).at[jnp.arange(B)[:, None], dest].set(x, mode="drop")


def _remove_specials(c):
    """`for s in SPECIAL_STRINGS: c = c.replace(s, "")` on byte strings c [B,L] (one traced
    pass in a loop). Each special string starts with `<`, ends with `>` and holds no other `<`
    or `>`, so its occurrences never overlap: removing all of them is str.replace."""
    table, lengths = _pattern_table(SPECIAL_STRINGS)
    W = table.shape[1]
    L = c.shape[1]

    def one(i, c):
        pat, n = jnp.asarray(table)[i], jnp.asarray(lengths)[i]
        used = jnp.arange(W) < n
        hit = jnp.all((_windows(c, W) == pat) | ~used, axis=2)  # [B,L]
        shifted = jnp.stack([jnp.pad(hit, ((0, 0), (j, 0)))[:, :L] for j in range(W)], axis=2)
        covered = jnp.any(shifted & used, axis=2)
        return _compact(c, (c != PAD) & ~covered)

    return jax.lax.fori_loop(0, len(SPECIAL_STRINGS), one, c)


def parse_pieces(x, max_actions: int, thinking: bool = True):
    """The reference's answer split on byte strings x [B,L] int32 (PAD-padded).

    First match of `<think>(.*?)</think>\\s*<answer>(.*?)</answer>` (DOTALL; without thinking
    `<answer>(.*?)</answer>`), special strings removed from the answer, split on `||`, pieces
    stripped, empties dropped, the first `max_actions` kept.
    Returns (answer c [B,L] int32: the answer's bytes after removing special strings, PAD
    after; first, last [B,max_actions] int32: the r-th piece is c[first..last] inclusive;
    has [B,max_actions] bool: slot r holds a piece; count [B] int32 of parsed actions).
    """
    B, L = x.shape
    pos = jnp.arange(L)[None]
    tags = _matches(x, (b"<answer>", b"</answer>", b"<think>", b"</think>"))
    aopen, aclose = tags[..., 0], tags[..., 1]
    last_close = jnp.max(jnp.where(aclose, pos, -1), axis=1)
    if thinking:
        # Leftmost start: if any <think> can start a match, the first one can (a later
        # </think> is also after it), so the match starts at the first <think>. Lazy group 1:
        # the first </think> after it followed by \s*<answer> and, later, some </answer>.
        i0 = _first(tags[..., 2], L)
        tclose = tags[..., 3] & (pos >= i0[:, None] + 7)
        nonspace = jnp.where(_isspace(x), L, pos)
        ws_next = jax.lax.cummin(nonspace, axis=1, reverse=True)  # first non-space at >= p
        k_of = jnp.pad(ws_next[:, 8:], ((0, 0), (0, 8)), constant_values=L)  # after </think>\s*
        opens = jnp.take_along_axis(aopen, jnp.minimum(k_of, L - 1), axis=1) & (k_of < L)
        cand = tclose & opens & (last_close[:, None] >= k_of + 8)
        k = _at(k_of, _first(cand, L), L)
    else:
        cand = aopen & (last_close[:, None] >= pos + 8)
        k = _first(cand, L)
    matched = cand.any(axis=1)
    begin = k + 8
    end = _first(aclose & (pos >= begin[:, None]), L)  # lazy group 2: the first </answer>
    span = jnp.where(matched, end - begin, 0)
    c = jnp.take_along_axis(x, jnp.clip(begin[:, None] + pos, 0, L - 1), axis=1)
    c = jnp.where(pos < span[:, None], c, PAD)  # the answer, left-aligned
    c = _remove_specials(c)

    pipe = c == ord("|")
    run_start = jax.lax.cummax(jnp.where(pipe, 0, pos + 1), axis=1)
    pipe_next = jnp.pad(pipe[:, 1:], ((0, 0), (0, 1)))
    sep = pipe & pipe_next & ((pos - run_start) % 2 == 0)  # non-overlapping "||" from the left
    sep_byte = sep | jnp.pad(sep[:, :-1], ((0, 0), (1, 0)))
    core = (c != PAD) & ~_isspace(c) & ~sep_byte
    piece = jnp.cumsum(sep, axis=1)  # piece index of non-separator bytes
    rows = jnp.arange(B)[:, None]
    first = jnp.full((B, L + 1), L, jnp.int32).at[rows, piece].min(jnp.where(core, pos, L))
    last = jnp.full((B, L + 1), -1, jnp.int32).at[rows, piece].max(jnp.where(core, pos, -1))
    nonempty = first < L
    rank = jnp.where(nonempty, jnp.cumsum(nonempty, axis=1) - 1, -1)
    count = jnp.minimum(jnp.sum(nonempty, axis=1), max_actions).astype(jnp.int32)

    # the r-th non-empty piece: its stripped text is c[f..e]
    slot = rank[:, :, None] == jnp.arange(max_actions)[None, None]  # [B,L+1,R]
    has = slot.any(axis=1)  # [B,R]
    q = jnp.argmax(slot, axis=1)  # [B,R]
    f = jnp.take_along_axis(first, q, axis=1)
    e = jnp.take_along_axis(last, q, axis=1)
    return c, f, e, has, count


def piece_bytes(c, first, last, has):
    """The pieces of `parse_pieces` as left-aligned byte strings [B,R,L] int32 (PAD after)."""
    L = c.shape[1]
    pos = jnp.arange(L)
    src = jnp.clip(first[:, :, None] + pos, 0, L - 1)  # [B,R,L]
    out = jnp.take_along_axis(c[:, None, :], src, axis=2)
    inside = has[:, :, None] & (pos <= (last - first)[:, :, None])
    return jnp.where(inside, out, PAD)


def parse_bytes(x, names: tuple, max_actions: int, thinking: bool = True):
    """The reference's answer parser on byte strings x [B,L] int32 (PAD-padded): the pieces
    of `parse_pieces` matched case-insensitively against the action `names`.
    Returns (name index [B,max_actions] int32: index into `names`, -1 for an invalid action
    or an empty slot; count [B] int32 of parsed actions).
    """
    c, f, e, has, count = parse_pieces(x, max_actions, thinking)
    B, L = c.shape
    lower = jnp.where((c >= ord("A")) & (c <= ord("Z")), c + 32, c)
    encoded = [n.lower().encode("utf-8") for n in names]
    hits = _matches(lower, encoded)  # [B,L,A]
    at_f = jnp.take_along_axis(hits, jnp.clip(f, 0, L - 1)[:, :, None], axis=1)  # [B,R,A]
    same_len = (e - f + 1)[:, :, None] == jnp.asarray([len(n) for n in encoded])[None, None]
    ok = at_f & same_len & has[:, :, None]
    idx = jnp.where(ok.any(axis=2), jnp.argmax(ok, axis=2), -1).astype(jnp.int32)
    return idx, count

