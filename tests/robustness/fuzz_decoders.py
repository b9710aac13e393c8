"""Mutated JPEGs through every decoder: run as ``python -X faulthandler -m tests.robustness.fuzz_decoders``.

Run in its own process by ``test_fuzz.py`` so that a crash in native decoding code (libjpeg-turbo, Pillow,
torchvision) fails that test with faulthandler's traceback instead of killing pytest. Each mutated input goes
through ``decode_scaled``, ``decode_pil``, the worker-side header check, the fast and reference transforms and
the device-decode batch logic on the CPU; each must return pixels of the right shape or raise ``DecodeError``
naming the sample. Anything else (another exception type, a crash, a hang past the deadline) is a bug.

Exit status: 0 when every example passed; 1 (with hypothesis' falsifying example) otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import timedelta

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.data.image_factory import exif_jpeg_bytes, jpeg_bytes, progressive_jpeg_bytes
from vlfit.data import decode
from vlfit.data.decode import DecodeError, check_image_header, decode_pil, decode_scaled
from vlfit.data.device_decode import decode_resize_batch
from vlfit.data.image_transforms import EncodedImage, FastImageTransform, ReferenceImageTransform

SIZE = 32
SAMPLE_ID = "fuzz-7"
# A mutated header can declare any size up to the bomb limit; a 178-megapixel decode (several GB as float in the
# reference pipeline) would only measure the machine. A low limit keeps every example small while still
# exercising the guard on each path.
FUZZ_MAX_IMAGE_PIXELS = 2_000_000
BASES = (
    jpeg_bytes(48, 40, subsampling=2, seed=1),
    progressive_jpeg_bytes(40, 32, seed=2),
    exif_jpeg_bytes(40, 48, 6, seed=3),
)
VALID_NEIGHBOUR = EncodedImage(jpeg_bytes(40, 40, seed=4), "neighbour")

_position = st.integers(min_value=0, max_value=1 << 16)
MUTATION = st.one_of(
    st.tuples(st.just("flip"), _position, st.integers(min_value=0, max_value=7)),
    st.tuples(st.just("truncate"), _position),
    st.tuples(st.just("insert"), _position, st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), _position, st.integers(min_value=1, max_value=64)),
    st.tuples(st.just("overwrite"), _position, st.binary(min_size=1, max_size=8)),
)

examples_run = 0


def mutate(data: bytes, mutations: list[tuple]) -> bytes:
    """Apply bit flips, truncations, insertions, deletions and overwrites (positions wrap around the data)."""
    out = bytearray(data)
    for kind, position, *arg in mutations:
        at = position % (len(out) + 1)
        if kind == "flip" and at < len(out):
            out[at] ^= 1 << arg[0]
        elif kind == "truncate":
            del out[at:]
        elif kind == "insert":
            out[at:at] = arg[0]
        elif kind == "delete":
            del out[at : at + arg[0]]
        elif kind == "overwrite":
            out[at : at + len(arg[0])] = arg[0]
    return bytes(out)


def check_every_decoder(data: bytes) -> None:
    """Each decoder returns the right shape or raises ``DecodeError`` naming the sample; anything else escapes."""
    decoders = {
        "header": lambda: check_image_header(data, SAMPLE_ID),
        "decode_scaled": lambda: decode_scaled(data, SIZE, SAMPLE_ID).shape[2] == 3 or _fail("not RGB"),
        "decode_pil": lambda: decode_pil(data, SAMPLE_ID).mode == "RGB" or _fail("not RGB"),
        "fast": lambda: FastImageTransform(SIZE)(data, SAMPLE_ID).shape == (3, SIZE, SIZE) or _fail("bad shape"),
        "reference": lambda: (
            ReferenceImageTransform(SIZE, (0.5,) * 3, (0.5,) * 3)(data, SAMPLE_ID).shape == (3, SIZE, SIZE)
            or _fail("bad shape")
        ),
        # Alone and next to a valid JPEG: the batched decode_jpeg call fails as a whole, then one by one.
        "device": lambda: decode_resize_batch([EncodedImage(data, SAMPLE_ID)], SIZE, "cpu"),
        "device_batch": lambda: decode_resize_batch([VALID_NEIGHBOUR, EncodedImage(data, SAMPLE_ID)], SIZE, "cpu"),
    }
    for name, run in decoders.items():
        try:
            run()
        except DecodeError as err:
            if not str(err).startswith(f"sample {SAMPLE_ID}: "):
                raise AssertionError(f"{name}: DecodeError does not name the sample: {err}") from err


def _fail(what: str) -> bool:
    raise AssertionError(what)


def build_test(max_examples: int) -> Callable[[], None]:
    """The hypothesis test, set to run ``max_examples`` examples."""

    @settings(
        max_examples=max_examples,
        deadline=timedelta(seconds=10),  # a hang detector: each example decodes a few tiny images
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(base=st.sampled_from(range(len(BASES))), mutations=st.lists(MUTATION, min_size=1, max_size=4))
    def fuzz(base: int, mutations: list[tuple]) -> None:
        global examples_run
        examples_run += 1
        check_every_decoder(mutate(BASES[base], mutations))

    return fuzz


def main(argv: list[str] | None = None) -> int:
    """Run the fuzz test; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=200)
    args = parser.parse_args(argv)
    decode.MAX_IMAGE_PIXELS = FUZZ_MAX_IMAGE_PIXELS
    build_test(args.max_examples)()
    print(f"fuzz examples run: {examples_run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
