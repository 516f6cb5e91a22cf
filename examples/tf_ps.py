"""A TensorFlow parameter-server job under rove: the coordinator (chief) script.

    rove run --standalone --tf-ps --num-ps 1 --num-workers 2 \\
        --checkpoint-dir /tmp/tf-ckpt examples/tf_ps.py --samples 20000

rove runs the parameter server and the workers (`rove.agent.tf_server`) with
their TF_CONFIG; this script is the chief. It builds a Keras model under
`ParameterServerStrategy`, leases shards of a generated regression data set
from the master (`ShardFeed`) and schedules one closure per shard: the worker
that runs it builds the shard's `tf.data` pipeline from its sample indices.
After every `--window` shards it joins the closures and saves a durable
checkpoint (`TfCheckpointer`) with the data position; once saved, the shards it
covers are acknowledged.

Failures: a worker killed is restarted in place by its agent and TensorFlow
retries its closures; a parameter server or this coordinator killed makes
the master restart the round, and this script resumes from its last
checkpoint, the master leasing again every shard trained after it.

`--trace FILE` appends one JSON line per completed closure (round, step, the
(epoch, index) of every sample) and one per start (the step restored): the
tests rebuild the final model's lineage from it (tests/lineage.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time

FEATURES = 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=20_000, help="samples per epoch")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--window", type=int, default=8, help="shards between checkpoints")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--trace", default="")
    args = p.parse_args()

    import tensorflow as tf

    from rove.agent.progress import report
    from rove.checkpoint.tf import TfCheckpointer
    from rove.shard_service.tf import ShardFeed

    began = time.monotonic()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.ParameterServerStrategy(resolver)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = tf.keras.Sequential(
            [tf.keras.layers.Dense(32, activation="relu"), tf.keras.layers.Dense(1)]
        )
        model.build((None, FEATURES))
        optimizer = tf.keras.optimizers.SGD(args.lr)
    ckpt = TfCheckpointer(tf.train.Checkpoint(model=model, optimizer=optimizer))
    feed = ShardFeed(
        "tf-regression",
        size=args.samples,
        shard_size=args.shard_size,
        epochs=args.epochs,
        seed=7,
    )
    step = 0
    restored = ckpt.restore()
    if restored is not None:
        step = int(restored.extra["step"])
        feed.load_state_dict(restored.extra["data"])
    round_ = int(os.environ.get("ROVE_ROUND", "0"))
    trace = open(args.trace, "a") if args.trace else None  # noqa: SIM115 - open all run

    def log(row: dict[str, object]) -> None:
        if trace is not None:
            trace.write(json.dumps({"round": round_, "rank": 0, **row}) + "\n")
            trace.flush()

    log({"restored": step})
    print(
        f"coordinator up in {time.monotonic() - began:.1f}s, "
        + (f"restored step {step}" if restored is not None else "fresh start"),
        flush=True,
    )
    truth = tf.constant([[0.5 * (i - FEATURES / 2)] for i in range(FEATURES)], tf.float32)

    @tf.function
    def train_shard(indices: tf.Tensor) -> tf.Tensor:
        def sample(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            x = tf.random.stateless_normal([FEATURES], seed=tf.stack([i, tf.constant(0, tf.int64)]))
            return x, tf.matmul(x[None, :], truth)[0]

        def replica(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        data = tf.data.Dataset.from_tensor_slices(indices).map(sample).batch(args.batch_size)
        total, batches = tf.constant(0.0), tf.constant(0.0)
        for x, y in data:
            total += strategy.run(replica, args=(x, y))
            batches += 1.0
        return total / tf.maximum(batches, 1.0)

    done = False
    while not done:
        window = []
        while len(window) < args.window:
            shard = feed.next()
            if shard is None:
                done = True
                break
            indices = tf.constant(shard.indices, dtype=tf.int64)
            window.append((shard, coordinator.schedule(train_shard, args=(indices,))))
        if not window:
            break
        coordinator.join()
        losses = []
        for shard, result in window:
            losses.append(float(result.fetch()))
            feed.trained(shard)
            step += 1
            report(step, samples=len(shard.indices))  # for rove status, hangs and goodput
            log(
                {
                    "step": step,
                    "t": time.time(),
                    "samples": [[shard.epoch, i] for i in shard.indices],
                }
            )
        saved = ckpt.save(step, extra={"step": step, "data": feed.state_dict()})
        feed.committed()
        print(
            f"step {step}  loss {sum(losses) / len(losses):.4f}  "
            f"checkpoint {saved.seconds * 1000:.0f} ms",
            flush=True,
        )
    print(f"done at step {step}", flush=True)
    feed.close()


if __name__ == "__main__":
    main()
