"""Registry calls made over HTTP: their errors become refusals with a status code
(shared by the ops API and the canary endpoints; a leaf module)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

from pipeline.redact import redact


def registry_call(call: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run a registry call; its errors become 4xx/502 refusals whose detail has URL credentials,
    secret query parameters and bearer tokens replaced by ``***`` (MLflow's messages quote the
    request URL, ``user:password@`` of the tracking URI included)."""
    from mlflow.exceptions import MlflowException

    from pipeline.registry.aliases import UnknownVersionError
    from pipeline.registry.models import RegistryError

    try:
        return call()
    except UnknownVersionError as err:
        raise HTTPException(404, redact(str(err))) from err
    except LookupError as err:
        raise HTTPException(404, redact(str(err))) from err
    except RegistryError as err:  # e.g. no earlier champion to roll back to
        raise HTTPException(409, redact(str(err))) from err
    except MlflowException as err:
        if err.error_code == "RESOURCE_DOES_NOT_EXIST":  # e.g. nothing registered yet for this model
            raise HTTPException(404, redact(err.message)) from err
        if err.error_code == "INVALID_PARAMETER_VALUE":  # e.g. a model name with '/': the caller's fault, not MLflow's
            raise HTTPException(422, redact(err.message)) from err
        raise HTTPException(502, f"MLflow: {redact(err.message)}") from err
