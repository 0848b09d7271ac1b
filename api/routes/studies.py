"""Studies: create, list, inspect, stop; their trials, Pareto front and recommendation.

Creating and stopping a study needs an admin token; reading needs none.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Path, Query, Response, status

from autotune.api.deps import AdminAuth, ServiceDep
from autotune.contract.protocol import NAME_PATTERN, StudySpec
from autotune.contract.recommendation import recommendation_yaml
from autotune.contract.views import Recommendation, StudyInfo, StudyList, TrialList

router = APIRouter(prefix="/studies", tags=["studies"])

StudyName = Path(..., pattern=NAME_PATTERN, description="the study's name")
ADMIN_ONLY: dict[int | str, dict[str, Any]] = {401: {"description": "no valid token (missing, unknown or revoked)"},
              403: {"description": "the token is not an admin token"}}


@router.post("", status_code=status.HTTP_201_CREATED, response_model=StudyInfo, responses=ADMIN_ONLY)
def create_study(spec: StudySpec, service: ServiceDep, _caller: AdminAuth) -> StudyInfo:
    """Create a study (409 if the name exists; 422 naming the bad field). Needs an admin token."""
    return service.create_study(spec)


@router.get("", response_model=StudyList)
def list_studies(service: ServiceDep) -> StudyList:
    studies = service.list_studies()
    return StudyList(data=studies, count=len(studies))


@router.get("/{name}", response_model=StudyInfo)
def get_study(service: ServiceDep, name: str = StudyName) -> StudyInfo:
    return service.get_study(name)


@router.delete("/{name}", response_model=StudyInfo, responses=ADMIN_ONLY)
def stop_study(service: ServiceDep, _caller: AdminAuth, name: str = StudyName) -> StudyInfo:
    """Stop the study: no more leases, running trials are told to stop. Its data is kept. Needs an admin token."""
    return service.stop_study(name)


@router.get("/{name}/trials", response_model=TrialList)
def list_trials(service: ServiceDep, name: str = StudyName) -> TrialList:
    trials = service.list_trials(name)
    return TrialList(data=trials, count=len(trials))


@router.get("/{name}/pareto", response_model=TrialList)
def pareto(service: ServiceDep, name: str = StudyName) -> TrialList:
    """The non-dominated completed trials."""
    trials = service.pareto(name)
    return TrialList(data=trials, count=len(trials))


@router.get("/{name}/best", response_model=Recommendation,
            responses={200: {"content": {"application/yaml": {}}}, 404: {"description": "nothing to recommend yet"}})
def best(service: ServiceDep, name: str = StudyName,
         format: Literal["json", "yaml"] = Query("json", description="json, or yaml for a config file")
         ) -> Recommendation | Response:
    """The fastest feasible completed trial and its speedup over the baseline (404 until there is one).
    format=yaml: the config as YAML (`autotune probe --config FILE` reads it) under a comment header."""
    recommendation = service.best(name)
    if format == "yaml":
        return Response(recommendation_yaml(recommendation), media_type="application/yaml")
    return recommendation
