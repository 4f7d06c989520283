"""A Request holds what it was given only if it is what it means: integer token ids, a whole
positive number of new tokens, a finite temperature >= 0; anything else is refused naming
the field and the value, before any engine sees it."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.engine.engine import Request, RequestError


def test_prompt_ids_are_kept_as_python_ints(rng):
    ids = rng.integers(0, 512, 7)
    req = Request([int(ids[0]), *ids[1:]], 3)  # a Python int, then NumPy int64 scalars
    assert req.prompt_ids == ids.tolist() and all(type(t) is int for t in req.prompt_ids)


@pytest.mark.parametrize("array", [np.asarray, jnp.asarray], ids=["numpy", "jax"])
@pytest.mark.parametrize("dtype", ["int32", "int64", "uint16"])
def test_a_1d_integer_array_is_a_prompt(rng, array, dtype):
    ids = rng.integers(0, 512, 9)
    req = Request(array(ids.astype(dtype)), 2)
    assert req.prompt_ids == ids.tolist() and all(type(t) is int for t in req.prompt_ids)


@pytest.mark.parametrize(
    "prompt,message",
    [
        ([1, 3.5, 2], "prompt_ids[1] is 3.5 (float); token ids are integers"),
        ([1, True], "prompt_ids[1] is True (bool); token ids are integers"),
        ([np.float32(4.0)], "prompt_ids[0] is 4.0 (float32); token ids are integers"),
        ([1, "2"], "prompt_ids[1] is '2' (str); token ids are integers"),
        ("3 14 15", "prompt_ids is a str; want a list of integer token ids or a 1-D integer array"),
        (np.array([1.0, 2.0]), "prompt_ids is a float64 array; want integer token ids"),
        (jnp.array([1.0, 2.0]), "prompt_ids is a float32 array; want integer token ids"),
        (np.array([True, False]), "prompt_ids is a bool array; want integer token ids"),
        (np.array([[1, 2], [3, 4]]), "prompt_ids is a 2-D array; want a 1-D one"),
        (jnp.array(3), "prompt_ids is a 0-D array; want a 1-D one"),
    ],
)
def test_prompt_ids_that_are_not_integers_are_named(prompt, message):
    with pytest.raises(RequestError) as error:
        Request(prompt, 4)
    assert str(error.value) == message


@pytest.mark.parametrize(
    "value,message",
    [
        (2.5, "max_new_tokens is 2.5 (float); want an integer >= 1"),
        (2.0, "max_new_tokens is 2.0 (float); want an integer >= 1"),
        (True, "max_new_tokens is True (bool); want an integer >= 1"),
        (0, "max_new_tokens is 0; want an integer >= 1"),
        (-3, "max_new_tokens is -3; want an integer >= 1"),
    ],
)
def test_max_new_tokens_is_a_positive_integer(value, message):
    with pytest.raises(RequestError) as error:
        Request([1, 2], value)
    assert str(error.value) == message


def test_max_new_tokens_may_be_a_numpy_integer():
    req = Request([1, 2], np.int64(3))
    assert req.max_new_tokens == 3 and type(req.max_new_tokens) is int


@pytest.mark.parametrize(
    "value,message",
    [
        (math.nan, "temperature is nan; want a finite number >= 0"),
        (math.inf, "temperature is inf; want a finite number >= 0"),
        (np.float32("nan"), "temperature is nan; want a finite number >= 0"),
        (-0.5, "temperature is -0.5; want a finite number >= 0"),
        ("0.7", "temperature is '0.7' (str); want a finite number >= 0"),
        (None, "temperature is None (NoneType); want a finite number >= 0"),
    ],
)
def test_temperature_is_finite_and_not_negative(value, message):
    with pytest.raises(RequestError) as error:
        Request([1, 2], 2, temperature=value)
    assert str(error.value) == message


def test_temperature_is_kept_as_a_python_float():
    for value in (0, 1, np.float32(0.5), 0.7):
        req = Request([1], 1, temperature=value)
        assert req.temperature == float(value) and type(req.temperature) is float
