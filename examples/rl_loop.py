"""An RL loop: a sampler, a reward model and a trainer on separate slices, overlapping.

The sampler acts with its own copy of the policy parameters; the trainer sends it
fresh parameters every SYNC_EVERY steps (a node on the sampler's slice that reads
the trainer's parameters and produces the sampler's next copy). Because the sampler
only depends on that copy, it can run ahead of the trainer between syncs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from rallypoint.client import Program

OBS, ACTIONS, BATCH = 8, 4, 64
SYNC_EVERY = 3
optimizer = optax.adam(5e-2)


def init_policy():
    return {"w": jnp.zeros((OBS, ACTIONS))}


def init_reward_model():
    return {"w": jax.random.normal(jax.random.PRNGKey(7), (OBS, ACTIONS))}


def prompts(step, microbatch):
    key = jax.random.fold_in(jax.random.PRNGKey(99), step)
    k_obs, k_noise = jax.random.split(key)
    return {"obs": jax.random.normal(k_obs, (BATCH, OBS)), "noise": jax.random.uniform(k_noise, (BATCH, ACTIONS))}


def sample(policy, obs, noise):
    gumbel = -jnp.log(-jnp.log(jnp.clip(noise, 1e-6, 1.0 - 1e-6)))
    return jnp.argmax(obs @ policy["w"] + gumbel, axis=-1).astype(jnp.int32)


def score(reward_model, obs, actions):
    best = jnp.argmax(obs @ reward_model["w"], axis=-1)
    return (actions == best).astype(jnp.float32)


def train(policy, opt_state, obs, actions, rewards):
    def loss_fn(p):
        logp = jax.nn.log_softmax(obs @ p["w"])
        chosen = jnp.take_along_axis(logp, actions[:, None], axis=-1)[:, 0]
        return -jnp.mean((rewards - jnp.mean(rewards)) * chosen)

    loss, grads = jax.value_and_grad(loss_fn)(policy)
    updates, opt_state = optimizer.update(grads, opt_state, policy)
    return {"policy": optax.apply_updates(policy, updates), "opt_state": opt_state, "loss": loss,
            "reward": jnp.mean(rewards)}


def build(steps: int = 30) -> Program:
    prog = Program("rl-loop", steps=steps, checkpoint_every=10)
    sampler = prog.slice("sampler", devices=1)
    reward = prog.slice("reward", devices=1)
    trainer = prog.slice("trainer", devices=1)

    policy = prog.state("policy", slice=trainer, init=init_policy)
    opt_state = prog.state("opt_state", slice=trainer, init=lambda: optimizer.init(init_policy()))
    sampler_policy = prog.state("sampler_policy", slice=sampler, init=init_policy)
    reward_model = prog.state("reward_model", slice=reward, init=init_reward_model)  # frozen: no producer

    batch = prog.source("prompts", prompts, slice=sampler, per="step", outputs=("obs", "noise"))
    actions = prog.node("sample", sample, slice=sampler,
                        inputs={"policy": sampler_policy, "obs": batch["obs"], "noise": batch["noise"]})
    rewards = prog.node("score", score, slice=reward,
                        inputs={"reward_model": reward_model, "obs": batch["obs"], "actions": actions})
    step = prog.node("train", train, slice=trainer,
                     inputs={"policy": policy, "opt_state": opt_state, "obs": batch["obs"], "actions": actions,
                             "rewards": rewards},
                     outputs=("policy", "opt_state", "loss", "reward"),
                     updates={"policy": policy, "opt_state": opt_state})
    prog.node("sync", lambda policy: {"policy": policy}, slice=sampler, every=SYNC_EVERY,
              inputs={"policy": policy}, outputs=("policy",), updates={"policy": sampler_policy})
    prog.metric("loss", step["loss"])
    prog.metric("reward", step["reward"])
    return prog


program = build()
