"""The reference's Bi-Arm Bandit as a pure-JAX environment (single turn, stochastic).

Two named arms: the low-risk arm pays 0.1 always, the high-risk arm pays 1.0 with p = 0.25 and
0.0 otherwise (mean 0.25 > 0.1). At reset the arm order is random (p = 0.5): action 1 pulls the
arm shown first, action 2 the arm shown second. Success = the high-risk arm was pulled, whatever
it paid. Done after one pull; a done bandit absorbs further actions (reward 0).

The env's text is the whole prompt (the reference's instruction and legend are empty), so the
names' order is the only per-state part of it: `arm_order` gives it on device and
`PROMPT_TEMPLATE` / `RESULT_TEMPLATE` hold the fixed text around the names.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from envs import text as env_text

# The reference's initial text with the arm names in action order (names a = action 1, b = 2).
PROMPT_TEMPLATE = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to"
    " pull. \nGame Rules: \n1. There are 2 arms, named {name_a} and {name_b}\n2. Each arm has"
    " its own reward distribution, related to their names. \n3. Analyze the symbolic meaning of"
    " each arm's name to guess how their reward distribution might behave.\n4. Based on the"
    " symbolic meaning of their names, which arm do you think is more likely to give higher"
    " rewards on average? Choose between {name_a} and {name_b}, and output like <answer> {name_a}"
    " </answer> or <answer> {name_b} </answer>.\n"
)
# The observation after the pull; the reward is printed as Python prints the float.
RESULT_TEMPLATE = "{arm}: {reward} points"

LOW_RISK_REWARD = 0.1
HIGH_RISK_WIN_PROB = 0.25
HIGH_RISK_WIN, HIGH_RISK_LOSS = 1.0, 0.0


@struct.dataclass
class BanditState:
    high_first: jax.Array  # bool[]: action 1 is the high-risk arm
    pulled: jax.Array  # int32[]: action taken (1 or 2), 0 before the pull
    reward: jax.Array  # float32[]: what the pull paid (0 before the pull)


@dataclasses.dataclass(frozen=True)
class Bandit:
    """Static settings: the tag and the two arm names (hashable: usable as a jit static arg)."""

    name: str = "Bandit"
    low_arm: str = "Phoenix"
    high_arm: str = "Dragon"

    instruction = ""
    legend = ""
    symbols = ()
    num_actions = 2

    def __post_init__(self):
        for field in ("low_arm", "high_arm"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip() or value != value.strip():
                raise ValueError(
                    f"Bandit {field} must be a non-empty name without surrounding spaces, got {value!r}"
                )
        if self.low_arm.lower() == self.high_arm.lower():
            raise ValueError(
                f"Bandit low_arm and high_arm must differ (case-insensitively), got {self.low_arm!r} "
                f"and {self.high_arm!r}"
            )

    @property
    def action_names(self):
        """(low-risk name, high-risk name): the names an answer is matched against.

        Unlike the grid games, which action id a name means depends on the state: use
        `name_to_action(state, index)`."""
        return (self.low_arm, self.high_arm)

    # the reference's budgets: one action a turn, one an episode
    budgets = (1, 1)

    def text(self, max_actions_per_turn: int, max_actions_per_traj: int):
        """How its states read, as pieces (`envs.text.EnvText`), with these budgets."""
        return _text(self, max_actions_per_turn, max_actions_per_traj)

    def reset(self, key):
        """Shuffle the arm order (p = 0.5 each way). -> BanditState."""
        return BanditState(
            high_first=jax.random.bernoulli(key),
            pulled=jnp.zeros((), jnp.int32),
            reward=jnp.zeros((), jnp.float32),
        )

    def step(self, key, state, action):
        """Pull arm `action` (1 or 2; others are no-ops). key: PRNG key for the payout.

        Returns (state, reward f32[], done bool[], info) with info bools `success` (the
        high-risk arm was pulled), `action_is_effective` (this call pulled an arm) and
        `action_is_valid` (action is 1 or 2).
        """
        action = jnp.asarray(action, jnp.int32)
        valid = (action == 1) | (action == 2)
        live = valid & (state.pulled == 0)
        is_high = (action == 1) == state.high_first
        win = jax.random.bernoulli(key, HIGH_RISK_WIN_PROB)
        pays = jnp.where(
            is_high, jnp.where(win, HIGH_RISK_WIN, HIGH_RISK_LOSS), LOW_RISK_REWARD
        ).astype(jnp.float32)
        new = BanditState(
            high_first=state.high_first,
            pulled=jnp.where(live, action, state.pulled),
            reward=jnp.where(live, pays, state.reward),
        )
        reward = jnp.where(live, pays, 0.0).astype(jnp.float32)
        info = {
            "success": self._pulled_high(new),
            "action_is_effective": live,
            "action_is_valid": valid,
        }
        return new, reward, new.pulled > 0, info

    def _pulled_high(self, state):
        return (state.pulled > 0) & ((state.pulled == 1) == state.high_first)

    def is_done(self, state):
        """bool[]: an arm has been pulled."""
        return state.pulled > 0

    def arm_order(self, state):
        """int32[2]: index into `action_names` of the arm behind action 1 and action 2."""
        high_first = state.high_first.astype(jnp.int32)
        return jnp.stack([high_first, 1 - high_first])

    def name_to_action(self, state, index):
        """Action id (1 or 2) pulling the arm named `action_names[index]`; 0 if out of range."""
        index = jnp.asarray(index, jnp.int32)
        first = (index == 1) == state.high_first
        return jnp.where((index == 0) | (index == 1), jnp.where(first, 1, 2), 0)

    # ----------------------------------------------------------- host text
    def to_text(self, state):
        """The reference's text: the prompt before the pull, then `"<Arm>: <reward> points"`."""
        names = [self.action_names[i] for i in np.asarray(self.arm_order(state))]
        pulled = int(state.pulled)
        if pulled == 0:
            return PROMPT_TEMPLATE.format(name_a=names[0], name_b=names[1])
        # The reference prints the payout as a Python float (0.1, 1.0, 0.0); round away the
        # float32 noise so 0.1 does not print as 0.10000000149011612.
        return RESULT_TEMPLATE.format(arm=names[pulled - 1], reward=round(float(state.reward), 6))

    def from_text(self, text):
        """State from the reference's prompt text (recovers the arm order; nothing pulled).

        Only the prompt identifies a state: the result text does not say the arm order.
        """
        for high_first, names in ((True, (self.high_arm, self.low_arm)), (False, self.action_names)):
            if text == PROMPT_TEMPLATE.format(name_a=names[0], name_b=names[1]):
                return BanditState(
                    high_first=jnp.asarray(high_first),
                    pulled=jnp.zeros((), jnp.int32),
                    reward=jnp.zeros((), jnp.float32),
                )
        raise ValueError(
            f"text is not the prompt of a Bandit with arms {self.action_names} "
            "(only the initial prompt can be loaded)"
        )


# envs.make(name): the variants of this env and their default options
VARIANTS = {
    "Bandit": (Bandit, dict(low_arm="Phoenix", high_arm="Dragon")),
    "BanditTest": (Bandit, dict(low_arm="Trader", high_arm="Librarian")),
}


# ----------------------------------------------------------------------------- text
def _text(env, max_actions_per_turn, max_actions_per_traj) -> env_text.EnvText:
    low, high = env.low_arm, env.high_arm
    pieces = (
        PROMPT_TEMPLATE.format(name_a=low, name_b=high),   # 0: low arm is action 1
        PROMPT_TEMPLATE.format(name_a=high, name_b=low),   # 1: high arm is action 1
        RESULT_TEMPLATE.format(arm=low, reward=LOW_RISK_REWARD),
        RESULT_TEMPLATE.format(arm=high, reward=HIGH_RISK_WIN),
        RESULT_TEMPLATE.format(arm=high, reward=HIGH_RISK_LOSS),
    )

    def render(state):
        pulled_high = (state.pulled == 1) == state.high_first
        after = jnp.where(pulled_high, jnp.where(state.reward > 0.5, 3, 4), 2)
        before = state.high_first.astype(jnp.int32)
        return jnp.where(state.pulled > 0, after, before).astype(jnp.int32)[None]

    prefix = env_text.prefix_text(env, max_actions_per_traj)
    return env_text.EnvText(pieces, 1, render, prefix, tuple(env.action_names),
                            max_actions_per_turn, max_actions_per_traj)
