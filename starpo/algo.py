"""The update's knobs as one hashable value: `AlgoConfig`, `config.algorithm` (`schema.Algorithm`)
plus what the update needs of the rollout, each checked by its rule on construction.
`run_config.algo_config(config)` makes it from a run's config."""

from __future__ import annotations

import dataclasses

from starpo import filtering, schema
from starpo.schema import ConfigError


@dataclasses.dataclass(frozen=True)
class AlgoConfig(schema.Algorithm):
    """The update's knobs (hashable): `config.algorithm` (schema.Algorithm) plus what it needs of
    the rollout, each checked by its rule on construction."""

    group_size: int = schema.knob(schema.Rollout.group_size, schema.SIZE)
    # the rollout's sampling temperature: the policy being optimised is the tempered one, so the
    # training forward divides logits by it too (as the reference's actor does)
    temperature: float = schema.knob(schema.Rollout.temperature, schema.TEMPERATURE)
    # max new tokens per turn (overlong shaping's Lmax)
    response_length: int = schema.knob(schema.Rollout.response_length, schema.SIZE)
    # turns per episode: a row holds at most max_turn x response_length sampled tokens, where
    # alone the update runs its output head (`update.head_positions`; 0 = at every position)
    max_turn: int = schema.knob(0, schema.COUNT)
    # the context window in turns (`RolloutSpec.context_window`): the training forward masks
    # attention the same way, so log-probs are those of the context each token was sampled in
    context_window: int = schema.knob(0, schema.COUNT)

    def __post_init__(self):
        """Every knob in its range; messages name the config key (`algorithm.x`, `rollout.x`)."""
        schema.check_fields(self, _key)
        if self.adv_estimator == "gigpo" and self.group_size < 2:
            raise ConfigError("algorithm.adv_estimator=gigpo compares episodes of one group: it "
                              f"needs rollout.group_size >= 2, got {self.group_size}")
        if self.overlong_buffer_len > self.response_length:
            raise ConfigError(f"algorithm.overlong_buffer_len {self.overlong_buffer_len} is more "
                              f"than rollout.response_length {self.response_length}")
        if self.ppo_mini_batch_size % self.micro_batch_size:
            raise ConfigError(f"algorithm.ppo_mini_batch_size {self.ppo_mini_batch_size} is not a "
                             f"multiple of algorithm.micro_batch_size {self.micro_batch_size}")

    def replace(self, **changes) -> "AlgoConfig":
        return dataclasses.replace(self, **changes)

    def static_groups(self, num_groups: int) -> int:
        """Groups of a rollout of `num_groups` in the update's batch (`filtering.static_groups`:
        the kept ones for top_k / top_k_abs, every one for the masked strategies)."""
        return filtering.static_groups(num_groups, self.rollout_filter_ratio,
                                       self.rollout_filter_strategy, self.rollout_filter_count,
                                       self.rollout_filter_include_zero)

    @property
    def masks_rows(self) -> bool:
        """Whether the rollout filter masks rows rather than gathering the kept ones
        (`filtering.masks_rows`)."""
        return filtering.masks_rows(self.rollout_filter_strategy,
                                    self.rollout_filter_include_zero)

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator not in ("grpo", "gigpo")

    @property
    def uses_reference(self) -> bool:
        return self.use_kl_loss or self.use_kl_in_reward


_FROM_ROLLOUT = tuple(f.name for f in dataclasses.fields(AlgoConfig)
                      if f.name not in schema.Algorithm.__dataclass_fields__)


def _key(name: str) -> str:
    """The config key of an AlgoConfig field (the rollout's come from `rollout`)."""
    return f"rollout.{name}" if name in _FROM_ROLLOUT else f"algorithm.{name}"
