"""The StarPO multi-turn rollout on device: text in, env steps, text out, one jitted program.

`make_rollout(env, tokenizer, model_cfg, spec, ...)` returns a `Rollout` whose `run(params, key,
seed, temperature, stream)` plays `env_groups x group_size` episodes of one env variant to the
end and returns a `Trajectory` (starpo/trajectory.py) plus a dict of per-episode metrics; the
`RolloutSpec` holds the settings every rollout of a run shares. The system prompt and the env
prefix (identical in every row) are appended once without a reply; then every turn (one
`lax.fori_loop` iteration, so the sampler and the parser are traced once) is

  observation piece ids -> tokens (gather) -> sampler turn (append + decode, KV cache kept)
  -> reply bytes (per-token byte table) -> parse (the reference's regex, on device)
  -> env steps (vmap, up to max_actions_per_turn, budget, done) -> next observation piece ids

The dialogue's text tables live in starpo/dialogue.py, the answer parser in starpo/parsing.py.

`make_mixed_rollout(((env_a, groups_a), (env_b, groups_b), ...), ...)` plays a batch that
mixes env variants (the reference's env tags with group counts): rows env by env, each with
its own env's prefix, observations, parser, budgets and dynamics (env states: a tuple, each
env vmapped over its static row slice), all decoded as one sampler batch; `Trajectory.tag` is
the env's index. A one-env rollout is the mix of one env.

`make_scripted_rollout(...)` runs the same loop with given (teacher-forced) replies and no
model (starpo/scripted.py): the golden-dialogue tests and launch/play.py use it.

Deliberate differences from the reference (see also dialogue.py and parsing.py):
- the trained tokens are the sampled tokens (no re-rendering of the parsed reply);
- a reply that ended on the end-of-turn token is followed by the rest of the template's
  end-of-message text; any other stop (`</answer>`, budget) by all of it.

An episode ends when the env is done, the action budget is spent, `max_turn` turns have passed,
or the context is full (`truncated`: the observation or the reply did not fit; never an error).

Rooms: `spec` (RolloutSpec), `layout` (a traced batch's tables, policy and carry), `episode` (the
loop), `levels` (initial states; chunked play), `models` (sampled replies), `given` (given
replies). This file re-exports their names: `rollout.X` for any of them.
"""

from __future__ import annotations

from starpo.rollout.spec import (  # noqa: F401
    FORMAT_PENALTY, CONTEXT_MULTIPLE, TRAIN, VALIDATION, RolloutSpec)
from starpo.rollout.layout import (  # noqa: F401
    Policy, TurnRecords, EpisodeCarry, context_length)
from starpo.rollout.episode import (  # noqa: F401
    anchor_hash)
from starpo.rollout.levels import (  # noqa: F401
    initial_states, mixed_initial_states, play_in_chunks, chunk_size, concat_rows)
from starpo.rollout.models import (  # noqa: F401
    Rollout, make_rollout, make_mixed_rollout, append_without_reply)
from starpo.rollout.given import (  # noqa: F401
    make_scripted_rollout, make_mixed_scripted_rollout, make_policy_rollout)
