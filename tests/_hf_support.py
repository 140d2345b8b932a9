"""Fixtures shared by the Hugging Face integration tests."""

from __future__ import annotations

import pytest

from rope_ops.integrations import transformers as integration


@pytest.fixture
def rope_ops_calls(monkeypatch):
    """Counts the calls the integration makes into rope_ops (proof that the patch is used)."""
    calls = []
    original = integration._api.apply

    def counting_apply(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(integration._api, "apply", counting_apply)
    return calls
