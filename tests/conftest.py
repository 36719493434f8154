"""Shared test setup: markers that skip themselves, and the correctness helpers."""

import shutil

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    has_nvcc = shutil.which("nvcc") is not None
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (GPU tests run on the H200)")
    skip_nvcc = pytest.mark.skip(reason="needs nvcc to compile TileLang kernels for sm_90a")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "compile" in item.keywords and not has_nvcc:
            item.add_marker(skip_nvcc)
