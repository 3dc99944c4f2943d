"""The README's example: optax_decoupled.adamw in a Flax NNX train step (runs on CPU or GPU)."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import optax_decoupled as od


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.gelu(self.norm(self.hidden(x))))


model = MLP(nnx.Rngs(0))
schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=20, decay_steps=300)
tx = optax.chain(
    optax.clip_by_global_norm(1.0),
    # decoupled decay theta <- theta - lr_t * 0.1 * theta per step; mask="auto" skips biases
    # and the norm scale (decay_convention="schedule", peak_learning_rate=3e-3 would decay by
    # 0.1 * lr_t / 3e-3 per step: 0.1 at the peak)
    od.adamw(schedule, weight_decay=0.1),
)
optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit(donate_argnums=(0, 1))  # new model and optimizer state in the old buffers
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


x = jax.random.normal(jax.random.key(1), (256, 8))
y = jnp.sin(x.sum(axis=1, keepdims=True))
losses = [float(train_step(model, optimizer, x, y)) for _ in range(300)]
print(f"loss: step 0 {losses[0]:.4f} -> step 299 {losses[-1]:.4f}")
