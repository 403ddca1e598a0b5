"""Benchmarks: `mtplxd bench` (decode.py, serve.py, sessions.py) and the engine's cycle and row timings."""


def model_folder(value: str) -> str:
    """argparse type for the engine-level benches' --model: a folder, or a model's name
    in the models folder or the repository it was pulled from, as `mtplxd bench` takes."""
    import argparse

    from mtplxd.config import resolve_state_dir
    from mtplxd.store.models import ModelError, resolve_model

    try:
        return str(resolve_model(value, resolve_state_dir()))
    except ModelError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
