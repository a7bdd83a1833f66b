import pytest


@pytest.fixture(scope="session")
def model_path() -> str:
    from gateway.backends.default_model import default_model_path

    return str(default_model_path())
