"""Shared fixtures: the rv1 checkpoints of the Hugging Face vectors, built once per session, and
the dense oracle loaded on them; the ouro-tiny preset (``tiny``) the offline API tests use."""

from __future__ import annotations

import pytest
import torch
from recipe import build_huginn_rv1, build_ouro_rv1
from reference import Reference


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker itself: ``item.keywords`` also holds the names of the test's folders, so a
        # checkout under a folder named "gpu" would skip every test.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def rv1_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rv1")


@pytest.fixture(scope="session")
def ouro_rv1(rv1_dir):
    return build_ouro_rv1(rv1_dir / "ouro")


@pytest.fixture(scope="session")
def huginn_rv1(rv1_dir):
    return build_huginn_rv1(rv1_dir / "huginn")


@pytest.fixture(scope="session")
def ouro_ref(ouro_rv1) -> Reference:
    return Reference.load(ouro_rv1)


@pytest.fixture(scope="session")
def huginn_ref(huginn_rv1) -> Reference:
    return Reference.load(huginn_rv1)


@pytest.fixture(scope="session")
def ckpts(ouro_rv1, huginn_rv1):
    return {"ouro": ouro_rv1, "huginn": huginn_rv1}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """The ouro-tiny preset (real tensor names, random values, vocab 512, a local tokenizer),
    built once; tests copy it before changing anything in it."""
    from rltserve.models.presets import make_model

    return make_model("ouro-tiny", tmp_path_factory.mktemp("tiny"))
