"""A training script with a bug: it raises before its first step."""

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    raise ValueError("learning rate must be positive, got -0.1")


if __name__ == "__main__":
    main()
