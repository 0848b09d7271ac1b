"""Studies: create, list, inspect, stop; their trials, Pareto front and recommendation."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Path, Query, Response, status

from api.deps import ServiceDep
from api.results import recommendation_yaml
from autotune.protocol import NAME_PATTERN, Recommendation, StudyInfo, StudyList, StudySpec, TrialList

router = APIRouter(prefix="/studies", tags=["studies"])

StudyName = Path(..., pattern=NAME_PATTERN, description="the study's name")


@router.post("", status_code=status.HTTP_201_CREATED, response_model=StudyInfo)
def create_study(spec: StudySpec, service: ServiceDep) -> StudyInfo:
    """Create a study (409 if the name exists; 422 naming the bad field)."""
    return service.create_study(spec)


@router.get("", response_model=StudyList)
def list_studies(service: ServiceDep) -> StudyList:
    studies = service.list_studies()
    return StudyList(data=studies, count=len(studies))


@router.get("/{name}", response_model=StudyInfo)
def get_study(service: ServiceDep, name: str = StudyName) -> StudyInfo:
    return service.get_study(name)


@router.delete("/{name}", response_model=StudyInfo)
def stop_study(service: ServiceDep, name: str = StudyName) -> StudyInfo:
    """Stop the study: no more leases, running trials are told to stop. Its data is kept."""
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
