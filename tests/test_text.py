"""Env text pieces spell the reference's text; piecewise vs whole-text tokenisation, measured."""

import jax.numpy as jnp
import numpy as np
import pytest

import envs
from envs import text as env_text
from starpo import dialogue

ENVS = ("SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "FrozenLake", "Bandit",
        "BanditTest")
# Levels in each env's text (reset is costly to compile; any states do for text checks).
LEVELS = {
    "SimpleSokoban": ["######\n#____#\n##O_P#\n###X_#\n###__#\n######",
                      "######\n#_P__#\n#_X__#\n#__O_#\n#____#\n######",
                      "######\n#__#_#\n#_XS_#\n#_X_O#\n#____#\n######"],
    "LargerSokoban": ["########\n#___#__#\n#_X____#\n#_O_P__#\n#___X__#\n#____O_#\n#______#\n########"],
    "SokobanDifferentGridVocab": ["WWWWWW\nW....W\nWWG.AW\nWWWB.W\nWWW..W\nWWWWWW"],
    "FrozenLake": ["_O_O\n_GO_\n____\nP___", "P___\n_O__\n__O_\n___G", "__O_\nOP__\n_GO_\n____",
                   "____\n_O_G\n__OP\n____"],
}


def _states(env, name):
    if name.startswith("Bandit"):
        out = []
        for high_first in (False, True):
            for pulled in (0, 1, 2):
                high = (pulled == 1) == high_first
                for r in ((1.0, 0.0) if high else (0.1,)) if pulled else (0.0,):
                    out.append(envs.BanditState(high_first=jnp.asarray(high_first),
                                                pulled=jnp.asarray(pulled, jnp.int32),
                                                reward=jnp.asarray(r, jnp.float32)))
        return out
    return [env.from_text(t) for t in LEVELS[name]]


@pytest.mark.parametrize("name", ENVS)
def test_pieces_spell_to_text(name):
    env = envs.make(name)
    t = env_text.make_text(env)
    for state in _states(env, name):
        env_text.check_render(t, env, state)


def test_prefix_is_the_reference():
    sok = env_text.make_text(envs.make("SimpleSokoban"))
    assert sok.prefix == (
        envs.make("SimpleSokoban").instruction + "\nThe meaning of each symbol in the state is:\n"
        "#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target"
        "\nYour available actions are:\nUp, Down, Left, Right\nYou can make up to 10 actions, "
        "separated by the action separator \" || \"\n")
    bandit = env_text.make_text(envs.make("Bandit"))
    assert bandit.prefix == "" and bandit.max_actions_per_turn == bandit.max_actions_per_traj == 1


def _observations(tables, etext, env, states, rng):
    """(piece ids, text) of first-turn and later-turn observations of the given states."""
    ids = tables.ids
    out = []
    for r in [np.asarray(etext.render(s)) for s in states]:
        state = [tables.env_offset + i for i in r if i >= 0]
        left = ids["left"][rng.integers(0, etext.max_actions_per_traj + 1)]
        out.append([ids["start"], ids["prefix"], ids["header1"][1]] + state + [left, ids["gen"]])
        reward = rng.choice([-0.1, -0.3, 0.0, 1.0, 10.8, -1.2, 0.9])
        digits = [ids["minus"]] if reward < 0 else []
        text = dialogue.short_decimal(reward)
        digits += [ids["digit"][int(ch)] if ch.isdigit() else ids["point"] for ch in text.lstrip("-")]
        k = int(rng.integers(2, 6))
        out.append([ids["close"], ids["reward"]] + digits + [ids["header2"][k]] + state
                   + [left, ids["gen"]])
    return out


def test_piecewise_tokenisation_vs_whole_text(smollm2):
    """The real tokenizer: pieces decode to the exact text; report how often the token split
    differs from tokenising the whole observation (grids are one piece per cell, so it does)."""
    tok = smollm2.tokenizer
    rng = np.random.default_rng(0)
    report = {}
    for name in ("SimpleSokoban", "FrozenLake", "Bandit"):
        env = envs.make(name)
        etext = env_text.make_text(env)
        tables = dialogue.build_tables(tok, etext, 5, 100)
        states = _states(env, name) * 4  # later turns draw other rewards and budgets
        obs = _observations(tables, etext, env, states, rng)
        differ = outside = 0
        for pieces in obs:
            toks = [t for p in pieces for t in tables.tokens[p, :tables.lengths[p]]]
            text = tables.text(pieces)
            assert tok.decode(toks) == text
            differ += toks != tok.encode(text)
            # the same with the state tokenised as one string: do the other seams hold?
            grid = [i for i, p in enumerate(pieces) if p >= tables.env_offset]
            before = [t for p in pieces[:grid[0]] for t in tables.tokens[p, :tables.lengths[p]]]
            after = [t for p in pieces[grid[-1] + 1:] for t in tables.tokens[p, :tables.lengths[p]]]
            whole_grid = before + tok.encode(tables.text(pieces[grid[0]:grid[-1] + 1])) + after
            outside += whole_grid != tok.encode(text)
        report[name] = (differ / len(obs), outside / len(obs), len(obs))
    print("piecewise != whole-text tokenisation (fraction of observations; with the state as "
          "one piece; count):", report)
    # Grids are tokenised cell by cell, whole rows merge symbols: Sokoban always differs.
    assert report["SimpleSokoban"][0] == 1.0
    assert all(r[1] == 0.0 for r in report.values())  # every other seam tokenises as a whole
    assert report["Bandit"][0] == 0.0


@pytest.mark.parametrize("name", ["FrozenLake", "SimpleSokoban", "Bandit"])
def test_max_state_tokens_bounds_every_state_and_is_tight(name):
    """The bound on a state's tokens (the observation chunk's width) holds for the levels above
    with long pieces for the player's symbols and one other symbol, and, hand-derived, lets the
    player alone take the long piece (the old bound: every slot at the longest piece)."""
    env = envs.make(name)
    t = env_text.make_text(env)
    lengths = [1] * len(t.pieces)
    long_ones = [len(t.pieces) - 2, 1] if name != "Bandit" else [0]  # a player symbol; another
    for i in long_ones:
        lengths[i] = 3
    bound = env_text.max_state_tokens(t, lengths)
    for state in _states(env, name):
        assert sum(lengths[i] for i in np.asarray(t.render(state)) if i >= 0) <= bound
    if name == "FrozenLake":  # 4x4: 19 slots, the player's at 3 tokens, the rest at 3 (`O`)
        assert bound == 3 * 19
        lengths[1] = 1  # only the player's symbols are long: 18 slots of 1 and 3 for the player
        assert env_text.max_state_tokens(t, lengths) == 18 + 3
    elif name == "SimpleSokoban":  # 6x6: 41 slots, player on target 3, empty (1) at 3 too
        assert env_text.max_state_tokens(t, lengths) == 41 * 3
        lengths[1] = 1
        assert env_text.max_state_tokens(t, lengths) == 40 + 3
    else:
        assert bound == 3


# A template with Qwen3's two habits, written here: `enable_thinking=False` puts an empty think
# block in the generation prompt, and an assistant turn before the last user message loses
# the text up to its `</think>`.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_user=0) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- set content = m.content -%}"
    "{%- if m.role == 'assistant' and '</think>' in content and loop.index0 < ns.last_user -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif -%}{%- endif -%}")


# A template with Gemma's habits, written here: the system text joins the first user turn,
# the assistant is "model", and every content is stripped of the whitespace around it.
TRIMMING_TEMPLATE = (
    "{{ '<bos>' }}{%- set first = messages[0].content + '\n\n' if messages[0].role == 'system'"
    " else '' -%}{%- set rest = messages[1:] if first else messages -%}"
    "{%- for m in rest -%}{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role)"
    " + '\n' + (first if loop.first else '') + (m.content | trim) + '<end_of_turn>\n' }}"
    "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


class _Rendered:
    eos_ids = ()

    def __init__(self, template=THINKING_TEMPLATE, **options):
        self.template, self.options = template, options

    def apply_chat_template(self, messages, add_generation_prompt=True):
        import jinja2

        return jinja2.Template(self.template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.options)

    def encode(self, text):
        return []

    def decode(self, ids):
        return ""


def test_a_thinking_switch_template_left_at_its_default_gives_the_plain_pieces():
    # the dialogue renders the template without enable_thinking (as the reference does): the
    # generation prompt is the plain assistant header, the same text as before a kept reply
    assert dialogue.chat_pieces(_Rendered()) == dict(
        start="<|im_start|>system\n", system_to_user="<|im_end|>\n<|im_start|>user\n",
        user_to_assistant="<|im_end|>\n<|im_start|>assistant\n",
        assistant_to_user="<|im_end|>\n<|im_start|>user\n", trims=())
    # thinking switched off, the generation prompt would carry an empty think block that no
    # kept reply has: refused in one line rather than a dialogue the reference never shows
    with pytest.raises(ValueError, match="generation prompt .*think"):
        dialogue.chat_pieces(_Rendered(enable_thinking=False))


def test_a_template_that_strips_contents_gets_stripped_contents():
    # the first prompt, built from pieces, is the template's own rendering of the reference's
    # messages: the user message's final newline stripped as it strips it (the system text,
    # which it does not strip, kept)
    env = envs.make("FrozenLake")
    etext = env_text.make_text(env)
    tok = _Rendered(TRIMMING_TEMPLATE)
    tables = dialogue.build_tables(tok, etext, max_turn=5, max_tokens=100)
    state = env.from_text(LEVELS["FrozenLake"][0])
    pieces = [tables.env_offset + i for i in np.asarray(etext.render(state)) if i >= 0]
    ids = tables.ids
    got = tables.text([ids["start"], ids["prefix"], ids["header1"][1]] + pieces
                      + [ids["left"][etext.max_actions_per_traj], ids["gen"]])
    header, footer = dialogue.turn_text(1, etext.max_actions_per_traj, 100, True)
    user = etext.prefix + header + env.to_text(state) + footer
    want = tok.apply_chat_template([{"role": "system", "content": dialogue.SYSTEM_PROMPT},
                                    {"role": "user", "content": user}]) + "<think>"
    assert got == want
    assert want.startswith("<bos><start_of_turn>user\nYou're a helpful assistant. \n\n")
    assert "(tokens).<end_of_turn>" in want  # the footer's newline stripped
