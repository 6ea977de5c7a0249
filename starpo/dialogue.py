"""The dialogue's text: the reference's prompts (docs/reference.md section 3) as token tables
and pieces.

The dialogue is rendered through the model's chat template: system `You're a helpful
assistant. `, first user message = env prefix + `\\nTurn 1:\\nState:\\n` + state +
`\\nYou have N actions left. Always output: ...\\n`, generation primed with `<think>`
(`<answer>` with thinking off); later user messages start `Reward:\\n{r}\\n`. The text is
built on device from pieces tokenised once on the host (`build_tables` -> `DialogueTables`;
`assemble` gathers them): template pieces are found by rendering the template with sentinel
contents (`chat_pieces`); grids are one piece per cell symbol. The decoded text equals the
reference's; the token split can differ from tokenising the whole text (grids: always, one
token per cell; every other seam: never, for SmolLM2 -- tests/test_text.py).

Rewards print as a short decimal (`-0.3`, `10.8`, `0.0`; at most 4 decimals, |r| < 10000;
`short_decimal` on the host, `reward_pieces` on device) instead of Python's float repr; a turn
in which nothing ran prints `0`, as the reference does. `dialogue_corpus` / `template_strings`:
the same strings as training text for a compact tiny tokenizer.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from envs import text as env_text

SYSTEM_PROMPT = "You're a helpful assistant. "
FORMAT_THINK = "<think> [Your thoughts] </think> <answer> [your answer] </answer>"
FORMAT_ANSWER = "<answer> [your answer] </answer>"
INT_DIGITS, FRAC_DIGITS = 4, 4  # reward text: up to 4 integer and 4 decimal digits


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



def chat_pieces(tokenizer) -> dict:
    """Template pieces from rendering the chat template with sentinel contents.

    Returns strings: `start` (everything before the system text), `system_to_user`,
    `user_to_assistant` (end of a user message + generation prompt), `assistant_to_user`, and
    `trims`: the roles ("system", "user") whose contents the template strips of the whitespace
    around them (Gemma's strips a user's), so that the dialogue strips its own contents alike.
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
    padded = tokenizer.apply_chat_template(
        [{**m, "content": f" {m['content']}\n"} for m in msgs[:2]], add_generation_prompt=True)
    trims = tuple(m["role"] for m, x in zip(msgs[:2], s) if f" {x}\n" not in padded)
    return dict(start=start, system_to_user=sys_user, user_to_assistant=user_asst,
                assistant_to_user=asst_user, trims=trims)


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
    # a template that strips message contents: the system text and each user message's end
    # (its last piece, the footer) stripped likewise, so the text is what the template renders
    trim = str.rstrip if "user" in chat["trims"] else (lambda x: x)
    system = system.strip() if "system" in chat["trims"] else system
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
    ids["left"] = np.array([add(f"left_{n}", trim(turn_text(1, n, max_tokens, thinking)[1]))
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
    a chat-template special token, plus the system prompt), and an env's `move_names` (the
    answers of a text-action env's solver) followed by `</answer>`: candidates for whole-string
    tokens (`Tokenizer.tiny(added_tokens=...)`) that make the context short."""
    out = [SYSTEM_PROMPT]
    for s in dialogue_pieces(env, **settings):
        if len(s) >= 8 and "<|" not in s and s not in out:
            out.append(s)
    # an env whose answers are text and not names (Sudoku): its solver's answers, whole
    return out + [f"{m}</answer>" for m in getattr(env, "move_names", ())]


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
        ip[:, None] >= env_text.powers_of_ten(INT_DIGITS)[None])
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


class Pieces(NamedTuple):
    """The piece tokens of every env of a batch in one table (what `assemble` gathers from)."""

    tokens: np.ndarray  # [P,W]
    lengths: np.ndarray  # [P]


def stack_pieces(tables) -> tuple[Pieces, np.ndarray]:
    """One piece table over the envs' tables, and each env's id offset in it."""
    width = max(t.tokens.shape[1] for t in tables)
    tokens = np.concatenate([np.pad(t.tokens, ((0, 0), (0, width - t.tokens.shape[1])))
                             for t in tables])
    offsets = np.cumsum([0] + [len(t.lengths) for t in tables])[:-1]
    return Pieces(tokens, np.concatenate([t.lengths for t in tables])), offsets


def state_pieces(etext, tables: DialogueTables, state):
    """Piece ids [b, etext.width] of b states of one env (0 = nothing)."""
    r = jax.vmap(etext.render)(state)
    return jnp.where(r >= 0, r + tables.env_offset, 0).astype(jnp.int32)


def chunk_width(etext, tables: DialogueTables) -> int:
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

