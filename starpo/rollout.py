"""The StarPO multi-turn rollout on device: text in, env steps, text out, one jitted program.

`make_rollout(...)` returns a `Rollout` whose jitted `run(params, key, seed, temperature,
stream)` plays `env_groups x group_size` episodes of one env variant to the end and returns a
`Trajectory` (starpo/trajectory.py) plus a dict of per-episode metrics. The system prompt and
the env prefix (identical in every row) are appended once without a reply; then every turn
(one `lax.fori_loop` iteration, so the sampler and the parser are traced once) is

  observation piece ids -> tokens (gather) -> sampler turn (append + decode, KV cache kept)
  -> reply bytes (per-token byte table) -> parse (the reference's regex, on device)
  -> env steps (vmap, up to max_actions_per_turn, budget, done) -> next observation piece ids

`make_mixed_rollout(((env_a, groups_a), (env_b, groups_b), ...), ...)` plays a batch that
mixes env variants (the reference's env tags with group counts): rows env by env, each with
its own env's prefix, observations, parser, budgets and dynamics (env states: a tuple, each
env vmapped over its static row slice), all decoded as one sampler batch; `Trajectory.tag` is
the env's index. A one-env rollout is the mix of one env.

The dialogue is the reference's (REFERENCE.md §3) rendered through the model's chat template:
system `You're a helpful assistant. `, first user message = env prefix + `\\nTurn 1:\\nState:\\n`
+ state + `\\nYou have N actions left. Always output: ...\\n`, generation primed with `<think>`
(`<answer>` with thinking off); later user messages start `Reward:\\n{r}\\n`. The text is built
on device from pieces tokenised once on the host (`DialogueTables`): template pieces are found by
rendering the template with sentinel contents; grids are one piece per cell symbol. The decoded
text equals the reference's; the token split can differ from tokenising the whole text (grids:
always, one token per cell; every other seam: never, for SmolLM2 -- tests/test_text.py).

`make_scripted_rollout(...)` runs the same loop with given (teacher-forced) replies and no
model: the golden-dialogue tests and launch/play.py use it.

Deliberate differences from the reference:
- rewards print as a short decimal (`-0.3`, `10.8`, `0.0`; at most 4 decimals, |r| < 10000)
  instead of Python's float repr; a turn in which nothing ran prints `0`, as the reference does;
- the trained tokens are the sampled tokens (no re-rendering of the parsed reply);
- parsing is on bytes with ASCII semantics: whitespace is ` \\t\\n\\r\\v\\f` and `\\x1c-\\x1f`
  (Python's non-ASCII whitespace such as U+00A0 is not stripped), lower-casing maps A-Z only;
- special tokens the model writes (e.g. its end-of-turn token) are not part of the parsed text,
  as with a server that decodes with skip_special_tokens;
- a reply that ended on the end-of-turn token is followed by the rest of the template's
  end-of-message text; any other stop (`</answer>`, budget) by all of it.

An episode ends when the env is done, the action budget is spent, `max_turn` turns have passed,
or the context is full (`truncated`: the observation or the reply did not fit; never an error).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs import text as env_text
from starpo import sampler as sampler_lib
from starpo.trajectory import Trajectory

SYSTEM_PROMPT = "You're a helpful assistant. "
FORMAT_THINK = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
FORMAT_ANSWER = "<answer> [your answer] </answer>"
FORMAT_PENALTY = -0.1
# The reference removes these strings from the answer, in this order, before splitting.
SPECIAL_STRINGS = (b"<think>", b"</think>", b"<answer>", b"</answer>", b"<|im_start|>", b"<|im_end|>")
WHITESPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"
PAD = -1  # byte value of padding in byte strings (real bytes are 0..255)
INT_DIGITS, FRAC_DIGITS = 4, 4  # reward text: up to 4 integer and 4 decimal digits
TRAIN, VALIDATION = 0, 1  # seed streams


def turn_text(k: int, actions_left: int, max_tokens: int, thinking: bool) -> tuple[str, str]:
    """(header, footer) of turn k around the state text, as the reference writes them."""
    fmt = FORMAT_THINK if thinking else FORMAT_ANSWER
    footer = (f"\nYou have {actions_left} actions left. Always output: {fmt} with no extra text. "
              f"Strictly follow this format. Max response length: {max_tokens} words (tokens).\n")
    return f"\nTurn {k}:\nState:\n", footer


def short_decimal(r: float) -> str:
    """Host twin of the on-device reward text: `-0.3`, `10.8`, `0.0`."""
    v = int(round(abs(r) * 10 ** FRAC_DIGITS))
    ip, fp = divmod(v, 10 ** FRAC_DIGITS)
    frac = f"{fp:0{FRAC_DIGITS}d}".rstrip("0") or "0"
    return ("-" if r < 0 and v else "") + f"{ip}.{frac}"


# ------------------------------------------------------------------------------ text tables
def chat_pieces(tokenizer) -> dict:
    """Template pieces from rendering the chat template with sentinel contents.

    Returns strings: `start` (everything before the system text), `system_to_user`,
    `user_to_assistant` (end of a user message + generation prompt), `assistant_to_user`.
    """
    s = [f"\x01SENTINEL{i}\x01" for i in range(4)]
    msgs = [{"role": "system", "content": s[0]}, {"role": "user", "content": s[1]},
            {"role": "assistant", "content": s[2]}, {"role": "user", "content": s[3]}]
    text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    parts, rest = [], text
    for sentinel in s:
        head, sep, rest = rest.partition(sentinel)
        if not sep:
            raise ValueError("chat template does not render message contents verbatim")
        parts.append(head)
    start, sys_user, user_asst, asst_user = parts
    gen = rest
    if gen != user_asst:
        raise ValueError(f"chat template: generation prompt {gen!r} differs from the text "
                         f"before an assistant message {user_asst!r}")
    return dict(start=start, system_to_user=sys_user, user_to_assistant=user_asst,
                assistant_to_user=asst_user)


@dataclasses.dataclass(frozen=True)
class DialogueTables:
    """Token tables of every piece of dialogue text, built once on the host.

    tokens [P, W] int32 (pad after lengths[p]), lengths [P]; named piece ids below.
    """

    strings: tuple
    tokens: np.ndarray
    lengths: np.ndarray
    ids: dict  # name -> piece id or np.ndarray of piece ids
    env_offset: int  # env state piece i is id env_offset + i
    close_by_eos: np.ndarray  # [len(eos_ids)] close piece to use after that EOS token
    eos_ids: np.ndarray

    def text(self, piece_ids) -> str:
        return "".join(self.strings[i] for i in piece_ids if i >= 0)


def build_tables(tokenizer, etext: env_text.EnvText, max_turn: int, max_tokens: int,
                 thinking: bool = True, system: str = SYSTEM_PROMPT) -> DialogueTables:
    """Tokenise every piece of the dialogue of one env variant."""
    chat = chat_pieces(tokenizer)
    strings, ids = [""], {}  # piece 0 is empty (padding)

    def add(name, s):
        ids[name] = len(strings)
        strings.append(s)
        return ids[name]

    add("start", chat["start"] + system + chat["system_to_user"])
    add("prefix", etext.prefix)
    add("gen", chat["user_to_assistant"] + ("<think>" if thinking else "<answer>"))
    add("close", chat["assistant_to_user"])
    add("reward", "Reward:\n")
    budget = etext.max_actions_per_traj
    ids["header1"] = np.array([0] + [add(f"h1_{k}", turn_text(k, 0, max_tokens, thinking)[0])
                                     for k in range(1, max_turn + 1)])
    ids["header2"] = np.array([0] + [add(f"h2_{k}", "\n" + turn_text(k, 0, max_tokens, thinking)[0])
                                     for k in range(1, max_turn + 1)])
    ids["left"] = np.array([add(f"left_{n}", turn_text(1, n, max_tokens, thinking)[1])
                            for n in range(budget + 1)])
    ids["digit"] = np.array([add(f"d{d}", str(d)) for d in range(10)])
    add("minus", "-")
    add("point", ".")
    eos = list(tokenizer.eos_ids)
    close_by_eos = []
    for e in eos:
        eos_text = tokenizer.decode([e])
        full = chat["assistant_to_user"]
        if eos_text and full.startswith(eos_text):
            close_by_eos.append(add(f"close_after_{e}", full[len(eos_text):]))
        else:
            close_by_eos.append(ids["close"])
    env_offset = len(strings)
    strings.extend(etext.pieces)

    toks = [tokenizer.encode(s) if s else [] for s in strings]
    width = max(1, max(len(t) for t in toks))
    table = np.zeros((len(toks), width), np.int32)
    for i, t in enumerate(toks):
        table[i, :len(t)] = t
    return DialogueTables(tuple(strings), table, np.array([len(t) for t in toks], np.int32), ids,
                          env_offset, np.array(close_by_eos, np.int32), np.array(eos, np.int32))


class _ChatMLText:
    """Just enough of a Tokenizer for `build_tables` to list the dialogue's strings (ChatML)."""

    eos_ids = ()

    def apply_chat_template(self, messages, add_generation_prompt=True):
        import jinja2

        from starpo.tokenizer import CHATML_TEMPLATE
        return jinja2.Template(CHATML_TEMPLATE).render(
            messages=messages, add_generation_prompt=add_generation_prompt)

    def encode(self, text):
        return []


def dialogue_corpus(env, *, max_turn: int = 5, max_new_tokens: int = 100, thinking: bool = True,
                    max_actions_per_turn: int | None = None,
                    max_actions_per_traj: int | None = None, length_prompt: int | None = None,
                    answer_repeats: int = 50) -> list[str]:
    """Training text for a compact tiny tokenizer (`Tokenizer.tiny(..., split="none",
    alphabet="corpus", builtin_corpus=False)`): every piece of dialogue text a rollout of `env`
    with these settings renders through the ChatML template (system prompt, env prefix, turn
    headers and footers, reward digits, state pieces), then each action name followed by
    `</answer>`, repeated `answer_repeats` times so that whole answers become single tokens."""
    pieces = dialogue_pieces(env, max_turn=max_turn, max_new_tokens=max_new_tokens,
                             thinking=thinking, max_actions_per_turn=max_actions_per_turn,
                             max_actions_per_traj=max_actions_per_traj,
                             length_prompt=length_prompt)
    return pieces + [name + "</answer>" for name in env.action_names] * answer_repeats


def dialogue_pieces(env, *, max_turn: int = 5, max_new_tokens: int = 100, thinking: bool = True,
                    max_actions_per_turn: int | None = None,
                    max_actions_per_traj: int | None = None,
                    length_prompt: int | None = None) -> list[str]:
    """The strings `build_tables` tokenises for a rollout of `env` with these settings (ChatML
    template; chat-template pieces include the special tokens' text)."""
    etext = env_text.make_text(env, max_actions_per_turn, max_actions_per_traj)
    tables = build_tables(_ChatMLText(), etext, max_turn, length_prompt or max_new_tokens,
                          thinking)
    return [s for s in tables.strings if s]


def template_strings(env, **settings) -> list[str]:
    """The long fixed texts of the dialogue (`dialogue_pieces` of 8 or more characters without
    a chat-template special token, plus the system prompt): candidates for whole-string
    tokens (`Tokenizer.tiny(added_tokens=...)`) that make the context short."""
    out = [SYSTEM_PROMPT]
    for s in dialogue_pieces(env, **settings):
        if len(s) >= 8 and "<|" not in s and s not in out:
            out.append(s)
    return out


def assemble(tables: DialogueTables, piece_ids, width: int):
    """Gather-and-concatenate: piece_ids [B,K] (-1 or 0 = nothing) -> (chunk [B,width] int32,
    valid [B,width] bool), tokens left-aligned. Pieces beyond `width` are cut (callers size
    `width` from the longest possible observation, so this does not happen)."""
    lengths = jnp.asarray(tables.lengths)[jnp.maximum(piece_ids, 0)]  # [B,K]
    lengths = jnp.where(piece_ids > 0, lengths, 0)
    ends = jnp.cumsum(lengths, axis=1)  # [B,K]
    col = jnp.arange(width)
    slot = jnp.sum(col[None, :, None] >= ends[:, None, :], axis=2)  # [B,C] which piece
    slot_c = jnp.minimum(slot, piece_ids.shape[1] - 1)
    start = jnp.take_along_axis(ends - lengths, slot_c, axis=1)
    piece = jnp.take_along_axis(piece_ids, slot_c, axis=1)
    tok = jnp.asarray(tables.tokens)[jnp.maximum(piece, 0), jnp.clip(col[None] - start, 0,
                                                                       tables.tokens.shape[1] - 1)]
    valid = col[None, :] < ends[:, -1:]
    return jnp.where(valid, tok, 0).astype(jnp.int32), valid


def reward_pieces(tables: DialogueTables, reward, ran):
    """Piece ids [B, 2+INT+FRAC] of the reward text: short decimal, or `0` if nothing ran."""
    scale = 10 ** FRAC_DIGITS
    v = jnp.round(jnp.abs(reward) * scale).astype(jnp.int32)
    v = jnp.minimum(v, 10 ** (INT_DIGITS + FRAC_DIGITS) - 1)
    ip, fp = v // scale, v % scale
    digits = jnp.asarray(tables.ids["digit"])
    int_d = jnp.stack([(ip // 10 ** i) % 10 for i in range(INT_DIGITS - 1, -1, -1)], 1)  # [B,4]
    int_keep = (jnp.arange(INT_DIGITS)[None] == INT_DIGITS - 1) | (
        ip[:, None] >= 10 ** jnp.arange(INT_DIGITS - 1, -1, -1)[None])
    frac_d = jnp.stack([(fp // 10 ** i) % 10 for i in range(FRAC_DIGITS - 1, -1, -1)], 1)
    # keep a fraction digit if it or anything after it is non-zero
    frac_keep = (jnp.arange(FRAC_DIGITS)[None] == 0) | (
        jnp.cumsum((frac_d > 0)[:, ::-1], axis=1)[:, ::-1] > 0)
    sign = jnp.where((reward < 0) & (v > 0), tables.ids["minus"], 0)
    pieces = jnp.concatenate([
        sign[:, None], jnp.where(int_keep, digits[int_d], 0),
        jnp.full((reward.shape[0], 1), tables.ids["point"]), jnp.where(frac_keep, digits[frac_d], 0)],
        axis=1)
    zero = jnp.zeros_like(pieces).at[:, 0].set(digits[0])
    return jnp.where(ran[:, None], pieces, zero).astype(jnp.int32)


# ------------------------------------------------------------------------------ parsing
def parse_byte_table(tokenizer, vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-token bytes for parsing: special tokens count as no text (skip_special_tokens).
    `vocab_size`: rows of the table (a model's embedding table may be larger than the
    tokenizer's vocabulary; ids without a token are no text)."""
    tb = _padded_token_bytes(tokenizer, vocab_size)
    for i in tokenizer.hf.all_special_ids:
        if 0 <= i < len(tb):
            tb[i] = b""
    return sampler_lib.byte_table(tb)


def _padded_token_bytes(tokenizer, vocab_size: int | None = None) -> list[bytes]:
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


def parse_bytes(x, names: tuple, max_actions: int, thinking: bool = True):
    """The reference's answer parser on byte strings x [B,L] int32 (PAD-padded).

    First match of `<think>(.*?)</think>\\s*<answer>(.*?)</answer>` (DOTALL; without thinking
    `<answer>(.*?)</answer>`), special strings removed from the answer, split on `||`, pieces
    stripped, empties dropped, the first `max_actions` kept.
    Returns (name index [B,max_actions] int32: index into `names` matched case-insensitively,
    -1 for an invalid action or an empty slot; count [B] int32 of parsed actions).
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
    lower = jnp.where((c >= ord("A")) & (c <= ord("Z")), c + 32, c)
    encoded = [n.lower().encode("utf-8") for n in names]
    hits = _matches(lower, encoded)  # [B,L,A]
    at_f = jnp.take_along_axis(hits, jnp.clip(f, 0, L - 1)[:, :, None], axis=1)  # [B,R,A]
    same_len = (e - f + 1)[:, :, None] == jnp.asarray([len(n) for n in encoded])[None, None]
    ok = at_f & same_len & has[:, :, None]
    idx = jnp.where(ok.any(axis=2), jnp.argmax(ok, axis=2), -1).astype(jnp.int32)
    return idx, count


# ------------------------------------------------------------------------------ scripted policy
@struct.dataclass
class ScriptState:
    """A policy-free stand-in for SamplerState: replies are given, not sampled."""

    tokens: jax.Array  # [B,S]
    logprobs: jax.Array  # [B,S]
    generated: jax.Array  # [B,S]
    end: jax.Array  # [B]


def script_turn(state: ScriptState, chunk, chunk_valid, active, reply, reply_len, reply_stop):
    """Append chunk then the given reply (teacher forcing), with the sampler's fit rules.

    reply [B,N] int32, reply_len [B], reply_stop [B] (the stop reason to report when it fits).
    Returns (state, Turn)."""
    B, S = state.tokens.shape
    C, N = chunk.shape[1], reply.shape[1]
    rows = jnp.arange(B)[:, None]
    span = jnp.max(jnp.where(chunk_valid, jnp.arange(C)[None] + 1, 0), axis=1)
    fits = state.end + span <= S
    live = active & fits & (span > 0) & (state.end + span < S)
    write = chunk_valid & (active & fits)[:, None]
    slots = jnp.where(write, state.end[:, None] + jnp.arange(C)[None], S)
    tokens = state.tokens.at[rows, slots].set(chunk, mode="drop")
    end = jnp.where(active & fits, state.end + span, state.end)
    n = jnp.where(live, jnp.minimum(reply_len, S - end), 0)
    rslots = jnp.where(jnp.arange(N)[None] < n[:, None], end[:, None] + jnp.arange(N)[None], S)
    tokens = tokens.at[rows, rslots].set(reply, mode="drop")
    generated = state.generated.at[rows, rslots].set(True, mode="drop")
    reason = jnp.where(live, jnp.where(n < reply_len, sampler_lib.CONTEXT_FULL, reply_stop),
                       jnp.where(active, sampler_lib.CONTEXT_FULL, sampler_lib.NOT_RUN))
    out = jnp.where(jnp.arange(N)[None] < n[:, None], reply, 0)
    turn = sampler_lib.Turn(out, jnp.zeros(out.shape, jnp.float32), n.astype(jnp.int32),
                            reason.astype(jnp.int32))
    return ScriptState(tokens, state.logprobs, generated, end + n), turn


def script_replies(tokenizer, replies: list[list[str]], max_turn: int, max_new_tokens: int,
                   stop: str = "</answer>"):
    """Host: reply texts [B][<=max_turn] -> (ids [B,M,N], len [B,M], stop [B,M]) numpy arrays.

    A reply is cut after its first `stop` (stop reason STOP_STRING) or end-of-sequence token
    (EOS, kept), else it ends on the budget (BUDGET); at most `max_new_tokens` tokens are kept, like the sampler. Rows with
    fewer replies than turns get empty ones (length 0): the episode ends there (after showing
    the next observation) if it has not ended before."""
    B = len(replies)
    ids = np.zeros((B, max_turn, max_new_tokens), np.int32)
    lens = np.zeros((B, max_turn), np.int32)
    stops = np.full((B, max_turn), sampler_lib.NOT_RUN, np.int32)
    for b, rs in enumerate(replies):
        if len(rs) > max_turn:
            raise ValueError(f"{len(rs)} replies for at most {max_turn} turns")
        for k, r in enumerate(rs):
            cut = r.find(stop) if stop else -1
            stops[b, k] = sampler_lib.BUDGET
            if cut >= 0:
                r = r[:cut + len(stop)]
                stops[b, k] = sampler_lib.STOP_STRING
            t = tokenizer.encode(r)
            eos = [i for i, x in enumerate(t) if x in tokenizer.eos_ids]
            if eos:  # the sampler stops on (and keeps) an end-of-sequence token
                t = t[:eos[0] + 1]
                stops[b, k] = sampler_lib.EOS
            t = t[:max_new_tokens]
            if not t:
                raise ValueError("a scripted reply must have at least one token")
            ids[b, k, :len(t)] = t
            lens[b, k] = len(t)
    return ids, lens, stops


# ------------------------------------------------------------------------------ the episode loop
@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    """Static settings of a rollout (hashable). Rows of `envs[i]` carry tag `tags[i]`."""

    envs: tuple
    tags: tuple
    max_turn: int
    max_context: int
    max_new_tokens: int
    thinking: bool


class _Pieces(NamedTuple):
    """The piece tokens of every env of a batch in one table (what `assemble` gathers from)."""

    tokens: np.ndarray  # [P,W]
    lengths: np.ndarray  # [P]


def _stack_pieces(tables) -> tuple[_Pieces, np.ndarray]:
    """One piece table over the envs' tables, and each env's id offset in it."""
    width = max(t.tokens.shape[1] for t in tables)
    tokens = np.concatenate([np.pad(t.tokens, ((0, 0), (0, width - t.tokens.shape[1])))
                             for t in tables])
    offsets = np.cumsum([0] + [len(t.lengths) for t in tables])[:-1]
    return _Pieces(tokens, np.concatenate([t.lengths for t in tables])), offsets


def _state_pieces(etext, tables: DialogueTables, state):
    """Piece ids [b, etext.width] of b states of one env (0 = nothing)."""
    r = jax.vmap(etext.render)(state)
    return jnp.where(r >= 0, r + tables.env_offset, 0).astype(jnp.int32)


def _chunk_width(etext, tables: DialogueTables) -> int:
    """Tokens of the widest observation chunk (the first one or a later one) of an env."""
    ids, maxlen = tables.ids, tables.lengths
    state_max = env_text.max_state_tokens(etext, maxlen[tables.env_offset:])
    first = (maxlen[ids["header1"][1]] + state_max + maxlen[ids["left"]].max()
             + maxlen[ids["gen"]])
    close_ids = np.concatenate([[ids["close"]], tables.close_by_eos])
    later = (maxlen[close_ids].max() + maxlen[ids["reward"]] + (2 + INT_DIGITS + FRAC_DIGITS)
             * maxlen[np.concatenate([ids["digit"], [ids["minus"], ids["point"]]])].max()
             + maxlen[ids["header2"][1:]].max() + state_max + maxlen[ids["left"]].max()
             + maxlen[ids["gen"]])
    return int(max(first, later))


def _play_actions(env, etext, thinking: bool, env_state, x, happened, budget_left, success,
                  keys):
    """Parse the replies of one env's rows and run their valid actions (env steps vmapped).

    x [b,L] reply bytes (`reply_bytes`), happened [b] (a reply was written), budget_left [b],
    success [b] (so far), keys [R',b] with R' >= etext.max_actions_per_turn.
    Returns (env_state, n_parsed, n_valid, reward, done, executed, effective_last, success,
    n_effective), the arrays [b]: this turn's, success and env state updated."""
    R = etext.max_actions_per_turn
    b = x.shape[0]
    name_idx, n_parsed = parse_bytes(x, etext.action_names, R, thinking)
    n_parsed = jnp.where(happened, n_parsed, 0)
    is_valid = (name_idx >= 0) & happened[:, None]
    n_valid = jnp.sum(is_valid, axis=1).astype(jnp.int32)
    order = jnp.argsort(~is_valid, axis=1, stable=True)
    valid_idx = jnp.take_along_axis(name_idx, order, axis=1)  # valid ones first

    def act(s, a):
        st, reward, done, executed, eff, succ, n_eff = a
        run = happened & (s < n_valid) & (s < budget_left) & ~done
        action = jax.vmap(env.name_to_action)(st, valid_idx[:, s])
        new, r, d, info = jax.vmap(env.step)(keys[s], st, action)
        st = jax.tree_util.tree_map(
            lambda n, o: jnp.where(run.reshape(run.shape + (1,) * (n.ndim - 1)), n, o), new, st)
        return (st, reward + jnp.where(run, r, 0.0), done | (run & d), executed + run,
                jnp.where(run, info["action_is_effective"], eff),
                succ | (run & info["success"]),
                n_eff + (run & info["action_is_effective"]))

    init = (env_state, jnp.zeros((b,), jnp.float32), jnp.zeros((b,), bool),
            jnp.zeros((b,), jnp.int32), jnp.zeros((b,), bool), success,
            jnp.zeros((b,), jnp.int32))
    st, reward, done, executed, eff_last, success, n_eff = jax.lax.fori_loop(0, R, act, init)
    return st, n_parsed, n_valid, reward, done, executed, eff_last, success, n_eff


def _episodes(spec: RolloutSpec, texts, tables, parse_table, prefill, policy_turn, pstate,
              env_states, group_id, key):
    """Play a batch of episodes of one or several env variants.

    env_states: a tuple with one state [B_i] per env variant (its `texts[i]`, `tables[i]`);
    rows are laid out env by env (B = sum B_i). Every row has its own env's prompt prefix,
    observations, parser, budgets and dynamics; all rows share one policy batch.
    prefill(pstate, chunk [B,P], valid [B,P]) -> pstate appends each row's fixed prompt prefix
    (left-aligned in the chunk) without replying; policy_turn(pstate, chunk, valid, key,
    active, k) -> (pstate, Turn) appends an observation and replies; pstate has
    tokens/logprobs/generated [B,S] and `end` [B].
    Returns (Trajectory, metrics, tuple of final env states)."""
    M = spec.max_turn
    B = group_id.shape[0]
    sizes = [jax.tree_util.tree_leaves(s)[0].shape[0] for s in env_states]
    if sum(sizes) != B:
        raise ValueError(f"env states of {sizes} rows for a batch of {B} rows")
    rows = [slice(int(e - n), int(e)) for e, n in zip(np.cumsum(sizes), sizes)]
    budget = jnp.asarray(np.repeat([t.max_actions_per_traj for t in texts], sizes), jnp.int32)
    prime = b"<think>" if spec.thinking else b"<answer>"
    table, tlens = (jnp.asarray(a) for a in parse_table)
    pieces, offsets = _stack_pieces(tables)

    def full(n, v):
        return jnp.full((n, 1), v, jnp.int32)

    def observation(per_env):
        """Piece ids [B,K] of the stacked table from each env's own piece ids [B_i,K_i]."""
        K = max(p.shape[1] for p in per_env)
        return jnp.concatenate([jnp.pad(jnp.where(p > 0, p + off, 0), ((0, 0), (0, K - p.shape[1])))
                                for p, off in zip(per_env, offsets)], axis=0)

    # The system prompt and the env prefix are the same in every row of an env and in every
    # episode: they are appended once, without a reply (left-aligned, padded to the longest
    # env's). Every turn's observation then has one width C, the widest env's.
    prefixes = [np.concatenate([t.tokens[i, :t.lengths[i]]
                                for i in (t.ids["start"], t.ids["prefix"])]) for t in tables]
    P = max(len(p) for p in prefixes)
    prefix = jnp.concatenate([jnp.broadcast_to(jnp.asarray(np.pad(p, (0, P - len(p))), jnp.int32),
                                               (n, P)) for p, n in zip(prefixes, sizes)])
    prefix_valid = jnp.concatenate([jnp.broadcast_to(jnp.arange(P) < len(p), (n, P))
                                    for p, n in zip(prefixes, sizes)])
    first_ids = observation([
        jnp.concatenate([full(n, t.ids["header1"][1]), _state_pieces(e, t, s),
                         full(n, t.ids["left"][e.max_actions_per_traj]), full(n, t.ids["gen"])],
                        axis=1)
        for e, t, s, n in zip(texts, tables, env_states, sizes)])
    widths = [_chunk_width(e, t) for e, t in zip(texts, tables)]
    C = max(widths)
    for p, w in zip(prefixes, widths):
        if len(p) + w >= spec.max_context:
            raise ValueError(f"max_context {spec.max_context} cannot hold the prompt prefix "
                             f"({len(p)} tokens) and a first observation ({w})")

    zeros_f = jnp.zeros((B, M), jnp.float32)
    zeros_i = jnp.zeros((B, M), jnp.int32)
    carry0 = dict(
        pstate=pstate, env=tuple(env_states), alive=jnp.ones((B,), bool),
        num_actions=jnp.zeros((B,), jnp.int32),
        success=jnp.zeros((B,), bool), penalty=jnp.zeros((B,), jnp.float32),
        truncated=jnp.zeros((B,), bool), turn_start=jnp.full((B, M), -1, jnp.int32),
        turn_end=jnp.full((B, M), -1, jnp.int32), turn_reward=zeros_f, ran=zeros_i,
        effective_last=zeros_i, n_parsed=zeros_i, n_valid=zeros_i, n_effective=zeros_i,
        last_token=jnp.zeros((B,), jnp.int32), last_reason=jnp.zeros((B,), jnp.int32),
        turn=None, end_before=jnp.zeros((B,), jnp.int32))

    def policy_step(c, k, chunk, valid, key):
        """Turn k's observation + reply (rows not alive are untouched; skipped if none is)."""
        def go(c):
            pstate, turn = policy_turn(c["pstate"], chunk, valid, key, c["alive"], k)
            return pstate, turn
        def skip(c):
            N = spec.max_new_tokens
            return c["pstate"], sampler_lib.Turn(jnp.zeros((B, N), jnp.int32),
                                                 jnp.zeros((B, N), jnp.float32),
                                                 jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32))
        end_before = c["pstate"].end
        pstate, turn = jax.lax.cond(jnp.any(c["alive"]), go, skip, c)
        return {**c, "pstate": pstate, "turn": turn, "end_before": end_before}

    def process(c, k, key):
        """Parse turn k's reply, run its actions, update the bookkeeping."""
        turn, pstate, end_before = c["turn"], c["pstate"], c["end_before"]
        happened = c["alive"] & (turn.length > 0)
        full_ctx = c["alive"] & (turn.stop_reason == sampler_lib.CONTEXT_FULL)

        x = reply_bytes(turn.tokens, turn.length, table, tlens, prime)
        budget_left = budget - c["num_actions"]
        keys = jax.random.split(key, (max(t.max_actions_per_turn for t in texts), B))
        per_env = [_play_actions(env, e, spec.thinking, s, x[r], happened[r], budget_left[r],
                                 c["success"][r], keys[:, r])
                   for env, e, s, r in zip(spec.envs, texts, c["env"], rows)]
        env_state = tuple(p[0] for p in per_env)
        n_parsed, n_valid, reward, done, executed, eff_last, success, n_eff = (
            jnp.concatenate(a) for a in zip(*(p[1:] for p in per_env)))
        num_actions = c["num_actions"] + executed
        bad = happened & ((n_valid != n_parsed) | (n_valid == 0))
        ended = c["alive"] & (done | (num_actions >= budget) | (k + 1 >= M) | full_ctx | ~happened)

        def put(a, v):
            return a.at[:, k].set(v)

        return dict(
            pstate=pstate, env=env_state, alive=c["alive"] & ~ended, num_actions=num_actions,
            success=success, penalty=c["penalty"] + jnp.where(bad, FORMAT_PENALTY, 0.0),
            truncated=c["truncated"] | full_ctx,
            turn_start=put(c["turn_start"], jnp.where(happened, end_before, -1)),
            turn_end=put(c["turn_end"], jnp.where(happened, pstate.end - 1, -1)),
            turn_reward=put(c["turn_reward"], jnp.where(happened, reward, 0.0)),
            ran=put(c["ran"], (executed > 0).astype(jnp.int32)),
            effective_last=put(c["effective_last"], eff_last.astype(jnp.int32)),
            n_parsed=put(c["n_parsed"], n_parsed), n_valid=put(c["n_valid"], n_valid),
            n_effective=put(c["n_effective"], n_eff),
            last_token=jnp.take_along_axis(turn.tokens, jnp.maximum(turn.length - 1, 0)[:, None],
                                           axis=1)[:, 0],
            last_reason=turn.stop_reason, turn=turn, end_before=end_before,
            reward=reward, any_ran=executed > 0)

    def next_ids(c, k):
        """Piece ids of the observation before turn k (k >= 1)."""
        is_eos = c["last_reason"] == sampler_lib.EOS
        per_env = []
        for e, t, s, r, n in zip(texts, tables, c["env"], rows, sizes):
            ids, budget_e = t.ids, e.max_actions_per_traj
            close = jnp.full((n,), ids["close"], jnp.int32)
            for eos, p in zip(t.eos_ids, t.close_by_eos):
                close = jnp.where(is_eos[r] & (c["last_token"][r] == eos), p, close)
            left = jnp.asarray(ids["left"])[jnp.clip(budget_e - c["num_actions"][r], 0, budget_e)]
            header = jnp.asarray(ids["header2"])[jnp.minimum(k + 1, M)]  # "Turn k+1"
            per_env.append(jnp.concatenate([
                close[:, None], full(n, ids["reward"]),
                reward_pieces(t, c["reward"][r], c["any_ran"][r]),
                jnp.broadcast_to(header, (n, 1)).astype(jnp.int32), _state_pieces(e, t, s),
                left[:, None], full(n, ids["gen"])], axis=1))
        return observation(per_env)

    def body(k, loop):
        c, key = loop
        key, k_env, k_pol = jax.random.split(key, 3)
        later = next_ids(c, k)
        first = jnp.pad(first_ids, ((0, 0), (0, later.shape[1] - first_ids.shape[1])))
        chunk, valid = assemble(pieces, jnp.where(k == 0, first, later), C)
        c = policy_step(c, k, chunk, valid, k_pol)
        return process(c, k, k_env), key

    # The barrier keeps XLA from constant-folding the prefix's forward pass (constant tokens
    # into an all-zero cache: minutes of compile time for nothing).
    pstate, prefix, prefix_valid = jax.lax.optimization_barrier((pstate, prefix, prefix_valid))
    pstate = prefill(pstate, prefix, prefix_valid)
    c = {**carry0, "pstate": pstate, "reward": jnp.zeros((B,), jnp.float32),
         "any_ran": jnp.zeros((B,), bool),
         "turn": sampler_lib.Turn(jnp.zeros((B, spec.max_new_tokens), jnp.int32),
                                  jnp.zeros((B, spec.max_new_tokens), jnp.float32),
                                  jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32))}
    c, _ = jax.lax.fori_loop(0, M, body, (c, key))

    ps = c["pstate"]
    T = ps.tokens.shape[1]
    length = ps.end
    posn = jnp.arange(T)[None]
    valid_tok = posn < length[:, None]
    started = (c["turn_start"] >= 0) & (c["turn_start"][:, :1] >= 0)
    starts = jnp.where(started, c["turn_start"], T + 1)
    turn_index = jnp.sum(posn[:, :, None] >= starts[:, None, :], axis=2) - 1
    turn_index = jnp.where(valid_tok, jnp.maximum(turn_index, 0), -1).astype(jnp.int32)
    loss_mask = ps.generated & valid_tok
    traj = Trajectory(
        tokens=jnp.where(valid_tok, ps.tokens, 0), loss_mask=loss_mask, turn_index=turn_index,
        sample_logprobs=jnp.where(loss_mask, ps.logprobs, 0.0), turn_end=c["turn_end"],
        turn_reward=c["turn_reward"], penalty=c["penalty"], success=c["success"],
        num_actions=c["num_actions"], group_id=group_id.astype(jnp.int32),
        tag=jnp.asarray(np.repeat(spec.tags, sizes), jnp.int32), length=length.astype(jnp.int32))
    turns = jnp.sum(c["turn_end"] >= 0, axis=1)
    per_turn = jnp.maximum(turns, 1).astype(jnp.float32)
    metrics = {
        # the reference's per-episode metrics: per turn, the last executed action's info,
        # averaged over the episode's turns (a turn where nothing ran counts 0)
        "action_is_valid": jnp.sum(c["ran"], axis=1) / per_turn,
        "action_is_effective": jnp.sum(c["effective_last"] * c["ran"], axis=1) / per_turn,
        "num_turns": turns.astype(jnp.int32),
        "num_parsed_actions": jnp.sum(c["n_parsed"], axis=1),
        "num_valid_actions": jnp.sum(c["n_valid"], axis=1),
        "num_effective_actions": jnp.sum(c["n_effective"], axis=1),
        "format_errors": jnp.sum((c["turn_end"] >= 0) & ((c["n_valid"] != c["n_parsed"])
                                                         | (c["n_valid"] == 0)), axis=1),
        "truncated": c["truncated"],
        "context_used": length.astype(jnp.int32),
        "response_length": jnp.sum(loss_mask, axis=1).astype(jnp.int32),
    }
    return traj, metrics, c["env"]


def _initial_states(env, key, seed, stream, env_groups, group_size):
    """One reset per group (key from stream and seed + group index), repeated group_size times."""
    group_seed = jnp.asarray(seed, jnp.int32) + jnp.arange(env_groups, dtype=jnp.int32)
    base = jax.random.fold_in(key, stream)
    keys = jax.vmap(lambda s: jax.random.fold_in(base, s))(group_seed)
    states = jax.vmap(env.reset)(keys)
    rep = lambda x: jnp.repeat(x, group_size, axis=0)  # noqa: E731
    return jax.tree_util.tree_map(rep, states), rep(group_seed)


def mixed_initial_states(mix, key, seed, stream, group_size):
    """Initial states of a mixed batch, mix = ((env, groups), ...): (a tuple with one state
    [groups_i * group_size] per env, group_id [B]). Group g of env i resets as in
    `_initial_states` from seed + (groups of the envs before i) + g, so every group of the
    batch has its own seed (its group id) and a batch of G groups uses seeds seed .. seed+G-1,
    as a single-env batch does."""
    states, group_ids, before = [], [], 0
    for env, groups in mix:
        s, g = _initial_states(env, key, jnp.asarray(seed, jnp.int32) + before, stream, groups,
                               group_size)
        states.append(s)
        group_ids.append(g)
        before += groups
    return tuple(states), jnp.concatenate(group_ids)


@dataclasses.dataclass(frozen=True)
class Rollout:
    """What `make_rollout` / `make_mixed_rollout` build: the jitted `run` and the host-side
    tables it closes over (one EnvText and DialogueTables per env variant)."""

    run: Callable
    # (params, key, env_state, group_id, temperature): given levels; env_state [B], or for a
    # mixed rollout a tuple with one state [B_i] per env
    run_from: Callable
    spec: RolloutSpec
    texts: tuple  # EnvText per env
    env_tables: tuple  # DialogueTables per env
    sampler: sampler_lib.Sampler

    @property
    def text(self) -> env_text.EnvText:
        """The EnvText of a one-env rollout."""
        return _only(self.texts)

    @property
    def tables(self) -> DialogueTables:
        """The DialogueTables of a one-env rollout."""
        return _only(self.env_tables)


def _only(per_env: tuple):
    if len(per_env) != 1:
        raise ValueError(f"a rollout of {len(per_env)} env variants has one per env "
                         "(Rollout.texts / Rollout.env_tables)")
    return per_env[0]


def make_rollout(env, tokenizer, model_cfg, *, env_groups: int, group_size: int,
                 max_turn: int = 5, max_new_tokens: int = 100, max_context: int = 2048,
                 thinking: bool = True, top_k: int = 0, top_p: float = 1.0,
                 max_actions_per_turn: int | None = None, max_actions_per_traj: int | None = None,
                 tag: int = 0, cache_dtype=None, length_prompt: int | None = None,
                 compiler_options: dict | None = None, prefill_dtype: str | None = None,
                 decode_windows: int = 1) -> Rollout:
    """A jitted full rollout of `env_groups x group_size` episodes of `env`.

    `Rollout.run(params, key, seed, temperature, stream)` -> (Trajectory, metrics):
      key: PRNG key of the sampler and env steps; the reset keys come from a fixed base
      (`jax.random.key(0)`) folded with `stream` (TRAIN=0, VALIDATION=1: disjoint levels) and
      `seed + g` for group g, so pass a counter (e.g. iteration * env_groups) for new levels;
      temperature: traced f32 (0 = greedy).
    metrics: dict of per-episode arrays [B]: action_is_valid, action_is_effective (the
    reference's per-turn averages), num_turns, num_parsed_actions, num_valid_actions,
    num_effective_actions, format_errors, truncated, context_used, response_length.
    Trajectory length T = max_context. `length_prompt` is the N of the prompt's "Max response
    length: N words (tokens)" (default max_new_tokens, as the reference). `compiler_options`
    go to `jax.jit` (e.g. {"xla_backend_optimization_level": 0}: faster compiles of tiny models
    on CPU). `Rollout.run_from(params, key, env_state [B], group_id [B], temperature)` plays
    given levels. Every row's Trajectory.tag is `tag`. `prefill_dtype`: matmul dtype of
    appending the prompt and the observations (many tokens per row: compute-bound); replies
    decode in `model_cfg.dtype` (None: that for both). `decode_windows`: see
    `sampler.Sampler.decode_windows` (early turns attend over the start of the context only).
    """
    r = make_mixed_rollout(((env, env_groups),), tokenizer, model_cfg, group_size=group_size,
                           max_turn=max_turn, max_new_tokens=max_new_tokens,
                           max_context=max_context, thinking=thinking, top_k=top_k, top_p=top_p,
                           max_actions_per_turn=max_actions_per_turn,
                           max_actions_per_traj=max_actions_per_traj, tags=(tag,),
                           cache_dtype=cache_dtype, length_prompt=length_prompt,
                           compiler_options=compiler_options, prefill_dtype=prefill_dtype,
                           decode_windows=decode_windows)
    mixed_from = r.run_from.__wrapped__

    def run_from(params, key, env_state, group_id, temperature):
        return mixed_from(params, key, (env_state,), group_id, temperature)

    return dataclasses.replace(r, run_from=jax.jit(run_from, compiler_options=compiler_options))


def make_mixed_rollout(mix, tokenizer, model_cfg, *, group_size: int, max_turn: int = 5,
                       max_new_tokens: int = 100, max_context: int = 2048,
                       thinking: bool = True, top_k: int = 0, top_p: float = 1.0,
                       max_actions_per_turn: int | None = None,
                       max_actions_per_traj: int | None = None, tags: tuple | None = None,
                       cache_dtype=None, length_prompt: int | None = None,
                       compiler_options: dict | None = None,
                       prefill_dtype: str | None = None, decode_windows: int = 1) -> Rollout:
    """A jitted rollout of one batch that mixes env variants: mix = ((env, groups), ...).

    Rows are laid out env by env, group by group (`groups_i x group_size` rows of env i); each
    row has its own env's prompt prefix, observations, answer parser, action budgets and
    dynamics, and every row is sampled in one batch by one sampler. Env i's rows carry
    Trajectory.tag `tags[i]` (default i). `max_actions_per_turn` / `max_actions_per_traj`
    apply to every env (None: each env's reference budget). Otherwise as `make_rollout`:
    `run(params, key, seed, temperature, stream)` resets group g of env i from
    seed + (groups of the envs before i) + g (`mixed_initial_states`);
    `run_from(params, key, env_states, group_id [B], temperature)` takes a tuple with one
    env state [groups_i * group_size] per env.
    """
    if not mix or any(int(g) < 1 for _, g in mix):
        raise ValueError(f"a rollout needs at least one env and >= 1 group per env, got "
                         f"{[(getattr(e, 'name', e), g) for e, g in mix]}")
    tags = tuple(range(len(mix))) if tags is None else tuple(tags)
    texts = tuple(env_text.make_text(e, max_actions_per_turn, max_actions_per_traj)
                  for e, _ in mix)
    tables = tuple(build_tables(tokenizer, t, max_turn, length_prompt or max_new_tokens, thinking)
                   for t in texts)
    smp = sampler_lib.make_sampler(model_cfg, tokenizer, max_new_tokens,
                                   stop=("</answer>",), top_k=top_k, top_p=top_p,
                                   prefill_dtype=prefill_dtype,
                                   decode_windows=decode_windows)
    prefill_cfg = model_cfg.replace(dtype=prefill_dtype or model_cfg.dtype)
    stop_table = tuple(jnp.asarray(a) for a in sampler_lib.byte_table(
        _padded_token_bytes(tokenizer, model_cfg.vocab_size)))
    parse_table = parse_byte_table(tokenizer, model_cfg.vocab_size)
    spec = RolloutSpec(tuple(e for e, _ in mix), tags, max_turn, max_context, max_new_tokens,
                       thinking)

    def run_from(params, key, env_states, group_id, temperature):
        pstate = sampler_lib.init_state(model_cfg, group_id.shape[0], max_context, cache_dtype)

        def policy_turn(ps, chunk, valid, k, active, turn_k):
            del turn_k
            st, turn = sampler_lib.run_turn(smp, params, ps.inner, chunk, valid, k,
                                            jnp.float32(temperature), active, stop_table)
            return _SamplerView(st), turn

        def prefill(ps, chunk, valid):
            return _SamplerView(append_without_reply(prefill_cfg, params, ps.inner, chunk, valid))

        traj, metrics, _ = _episodes(spec, texts, tables, parse_table, prefill, policy_turn,
                                     _SamplerView(pstate), env_states, group_id, key)
        return traj, metrics

    def run(params, key, seed, temperature, stream=TRAIN):
        env_states, group_id = mixed_initial_states(mix, jax.random.key(0), seed, stream,
                                                    group_size)
        return run_from(params, key, env_states, group_id, temperature)

    jit = functools.partial(jax.jit, compiler_options=compiler_options)
    return Rollout(jit(run), jit(run_from), spec, texts, tables, smp)


def append_without_reply(cfg, params, state: sampler_lib.SamplerState, chunk, valid=None):
    """Append chunk [B,P] (valid [B,P], left-aligned; default all) at every row's offset of an
    *empty* sampler state and write its keys/values, without decoding a reply (the prompt
    prefix). The sampler's own append (`sampler.append`), minus its decode loop."""
    params = jax.tree_util.tree_map(lambda p: p.astype(jnp.dtype(cfg.dtype)), params)
    valid = jnp.ones(chunk.shape, bool) if valid is None else valid
    return sampler_lib.append(params, cfg, state, chunk, valid, fresh=True)[1]


@struct.dataclass
class _SamplerView:
    """SamplerState with the `end` the episode loop reads."""

    inner: sampler_lib.SamplerState

    @property
    def end(self):
        return self.inner.cache.end

    @property
    def tokens(self):
        return self.inner.tokens

    @property
    def logprobs(self):
        return self.inner.logprobs

    @property
    def generated(self):
        return self.inner.generated


def make_scripted_rollout(env, tokenizer, *, max_turn: int = 5, max_new_tokens: int = 100,
                          max_context: int = 2048, thinking: bool = True,
                          max_actions_per_turn: int | None = None,
                          max_actions_per_traj: int | None = None, tag: int = 0,
                          length_prompt: int | None = None):
    """The same episode loop with given replies instead of a model (tests, launch/play.py).

    Returns (play, tables) where jitted `play(env_state [B], reply_ids [B,M,N], reply_len [B,M],
    reply_stop [B,M], key)` -> (Trajectory, metrics, final env state); build the reply arrays
    with `script_replies`. group_id is the row index. Cached: the same settings share one
    compiled program.
    """
    play, tables = _scripted((env,), (tag,), tokenizer, max_turn, max_new_tokens, max_context,
                             thinking, max_actions_per_turn, max_actions_per_traj,
                             length_prompt or max_new_tokens)

    def play_one(env_state, reply_ids, reply_len, reply_stop, key):
        traj, metrics, final = play((env_state,), reply_ids, reply_len, reply_stop, key)
        return traj, metrics, final[0]

    return play_one, tables[0]


def make_mixed_scripted_rollout(env_list, tokenizer, *, max_turn: int = 5,
                                max_new_tokens: int = 100, max_context: int = 2048,
                                thinking: bool = True, max_actions_per_turn: int | None = None,
                                max_actions_per_traj: int | None = None,
                                length_prompt: int | None = None):
    """`make_scripted_rollout` of a batch that mixes env variants (`env_list`, a tuple of envs;
    env i's rows carry tag i), as `make_mixed_rollout` plays it.

    Returns (play, tables per env) where jitted `play(env_states, reply_ids [B,M,N], reply_len
    [B,M], reply_stop [B,M], key)` takes a tuple with one state [B_i] per env (rows env by
    env) and returns (Trajectory, metrics, tuple of final env states).
    """
    return _scripted(tuple(env_list), tuple(range(len(env_list))), tokenizer, max_turn,
                     max_new_tokens, max_context, thinking, max_actions_per_turn,
                     max_actions_per_traj, length_prompt or max_new_tokens)


@functools.lru_cache(maxsize=8)
def _scripted(env_list, tags, tokenizer, max_turn, max_new_tokens, max_context, thinking,
              max_actions_per_turn, max_actions_per_traj, length_prompt):
    texts = tuple(env_text.make_text(e, max_actions_per_turn, max_actions_per_traj)
                  for e in env_list)
    tables = tuple(build_tables(tokenizer, t, max_turn, length_prompt, thinking) for t in texts)
    parse_table = parse_byte_table(tokenizer)
    spec = RolloutSpec(env_list, tags, max_turn, max_context, max_new_tokens, thinking)

    def play(env_states, reply_ids, reply_len, reply_stop, key):
        B = reply_ids.shape[0]
        ps = ScriptState(jnp.zeros((B, max_context), jnp.int32),
                         jnp.zeros((B, max_context), jnp.float32),
                         jnp.zeros((B, max_context), bool), jnp.zeros((B,), jnp.int32))

        def policy_turn(ps, chunk, valid, k, active, turn_k):
            del k
            take = lambda a: jax.lax.dynamic_index_in_dim(a, turn_k, axis=1, keepdims=False)  # noqa: E731
            return script_turn(ps, chunk, valid, active, take(reply_ids), take(reply_len),
                               take(reply_stop))

        def prefill(ps, chunk, valid):
            # a shorter prefix's padding lies past its row's end: later writes replace it
            tokens = jax.lax.dynamic_update_slice(ps.tokens, chunk, (0, 0))
            return ps.replace(tokens=tokens, end=ps.end + jnp.sum(valid, axis=1))

        return _episodes(spec, texts, tables, parse_table, prefill, policy_turn, ps, env_states,
                         jnp.arange(B, dtype=jnp.int32), key)

    return jax.jit(play), tables
