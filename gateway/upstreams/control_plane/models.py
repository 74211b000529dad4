"""The control plane's requests and answers, declared once: the handlers validate with these
models and the OpenAPI document (``/openapi.json``) is generated from them.

Unknown fields in a body are refused (a typo is caught instead of ignored). A field that may
be left out is not null unless its type says so. A create body carries every field its
source needs, and a PATCH cannot empty one, so a deployment is always complete. What no
model can check, because it depends on configuration or on what a build would do, is in
``rules.py``.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.config import JsonDict
from typing_extensions import TypedDict

# Every text of the control plane is checked as ``STORABLE_TEXT``: a UTF-8 form and no NUL,
# which PostgreSQL's text columns refuse.
from gateway.upstreams.http_api.json_values import (
    INTEGRAL,
    STORABLE_TEXT,
    JsonObject,
    invalid_at,
    omissible,
)

MAX_NAME = 128
MAX_TEXT = 2048
MAX_SECRET_VALUE = 64 * 1024
MAX_SECRETS = 100
MAX_LIST = 100
MAX_PAGE = 100
DEFAULT_PAGE = 20
MAX_OFFSET = 10_000_000
MAX_PATH_ID = 256

NOT_BLANK = r"\S"
SECRET_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"  # noqa: S105 - a pattern, not a secret
PROVIDER_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# An absolute http(s) URL with a host; no spaces or control characters anywhere.
_URL_BODY = r"https?://[^/?#\x00-\x20\x7f]+(?:[/?#][^\x00-\x20\x7f]*)?"
HTTP_URL = rf"^{_URL_BODY}$"
HTTP_URL_OR_EMPTY = rf"^(?:{_URL_BODY})?$"
# An http(s) URL without a fragment: an OAuth authorization endpoint (RFC 6749 3.1), whose
# flow parameters are appended to its query (after a '#' a browser never sends them).
HTTP_URL_NO_FRAGMENT = r"^https?://[^/?#\x00-\x20\x7f]+(?:[/?][^#\x00-\x20\x7f]*)?$"

# What each pattern means, for error details.
PATTERNS = {
    NOT_BLANK: "must not be blank",
    SECRET_NAME: "letters, digits and '_', not starting with a digit",
    PROVIDER_ID: "letters, digits, '.', '_' or '-', starting with a letter or digit",
    HTTP_URL: "expected an http(s) URL",
    HTTP_URL_NO_FRAGMENT: "expected an http(s) URL without a fragment ('#...': the flow's "
    "parameters are appended to its query)",
    HTTP_URL_OR_EMPTY: "expected an http(s) URL",
}

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=NOT_BLANK), STORABLE_TEXT]
ShortText = Annotated[str, Field(max_length=MAX_NAME), STORABLE_TEXT]
Text = Annotated[str, Field(max_length=MAX_TEXT), STORABLE_TEXT]
FilledText = Annotated[str, Field(min_length=1, max_length=MAX_TEXT), STORABLE_TEXT]
RequiredText = Annotated[
    str, Field(min_length=1, max_length=MAX_TEXT, pattern=NOT_BLANK), STORABLE_TEXT
]
HttpUrl = Annotated[str, Field(min_length=1, max_length=MAX_TEXT, pattern=HTTP_URL), STORABLE_TEXT]
PathId = Annotated[str, Field(min_length=1, max_length=MAX_PATH_ID), STORABLE_TEXT]

AuthUrl = Annotated[
    str, Field(min_length=1, max_length=MAX_TEXT, pattern=HTTP_URL_NO_FRAGMENT), STORABLE_TEXT
]
"""An identifier in a path (deployment, revision, listener, provider, flow, integration)."""


class _Body(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---- deployments --------------------------------------------------------------------------

DeploymentType = Literal["dev", "prod"]


class _SourceConfig(_Body):
    deployment_type: DeploymentType = omissible()
    build_on_push: bool = omissible()
    custom_url: Text | None = None
    resource_spec: JsonObject | None = None
    listener_id: Text | None = None
    listener_config: JsonObject | None = None

    def given(self) -> dict[str, Any]:
        """The fields the request named."""
        return self.model_dump(exclude_unset=True)


class SourceConfig(_SourceConfig):
    """Where an ``external_docker`` deployment's code comes from (nothing is needed)."""

    integration_id: Text | None = None
    repo_url: Text | None = None


class GithubSourceConfig(_SourceConfig):
    """The source of a ``github`` deployment: the integration and the repository."""

    integration_id: FilledText
    repo_url: FilledText


class SourceConfigPatch(_SourceConfig):
    """Any subset of a deployment's source config. ``integration_id`` and ``repo_url`` are
    never emptied: a deployment keeps what its source needs."""

    integration_id: FilledText = omissible()
    repo_url: FilledText = omissible()


_ONE_CONFIG_PATH = (
    "langgraph_config_path and graph_config_path are two names of one field: give one"
)
_ONE_NAME: JsonDict = {"not": {"required": ["langgraph_config_path", "graph_config_path"]}}


class _RevisionConfig(_Body):
    """``graph_config_path`` is another name of ``langgraph_config_path``: give one."""

    model_config = ConfigDict(json_schema_extra=_ONE_NAME)

    @model_validator(mode="after")
    def _one_config_path(self) -> _RevisionConfig:
        if {"langgraph_config_path", "graph_config_path"} <= self.model_fields_set:
            raise invalid_at(["graph_config_path"], _ONE_CONFIG_PATH)
        return self

    def given(self) -> dict[str, Any]:
        """The fields the request named, the config path under its stored name."""
        given = self.model_dump(exclude_unset=True)
        if "graph_config_path" in given:
            given["langgraph_config_path"] = given.pop("graph_config_path")
        return given


class GithubRevisionConfig(_RevisionConfig):
    """What a ``github`` revision builds: a reference and the config path (either name)."""

    model_config = ConfigDict(
        json_schema_extra={
            **_ONE_NAME,
            "anyOf": [
                {"required": ["langgraph_config_path"]},
                {"required": ["graph_config_path"]},
            ],
        }
    )

    repo_ref: FilledText
    langgraph_config_path: FilledText = omissible()
    graph_config_path: FilledText = omissible()
    image_uri: Text | None = None

    @model_validator(mode="after")
    def _config_path_given(self) -> GithubRevisionConfig:
        if not {"langgraph_config_path", "graph_config_path"} & self.model_fields_set:
            raise invalid_at(["langgraph_config_path"], "field required for source github")
        return self


class DockerRevisionConfig(_RevisionConfig):
    """What an ``external_docker`` revision runs: an image."""

    repo_ref: Text | None = None
    langgraph_config_path: Text | None = None
    graph_config_path: Text | None = None
    image_uri: FilledText


class RevisionConfigPatch(_RevisionConfig):
    """Any subset of a deployment's revision config. Fields are never emptied: a deployment
    keeps what its source needs."""

    repo_ref: FilledText = omissible()
    langgraph_config_path: FilledText = omissible()
    graph_config_path: FilledText = omissible()
    image_uri: FilledText = omissible()


class Secret(_Body):
    """A named secret value; values are write-only (answers show names only)."""

    name: Annotated[str, Field(max_length=MAX_NAME, pattern=SECRET_NAME)]
    value: Annotated[str, Field(max_length=MAX_SECRET_VALUE), STORABLE_TEXT]


Secrets = Annotated[
    list[Secret],
    Field(
        max_length=MAX_SECRETS,
        description="A name given twice is one secret: its last value counts",
    ),
]


def secret_pairs(secrets: list[Secret] | None) -> list[tuple[str, str]]:
    """Secrets as (name, value), each name once (in the order first given, the last value)."""
    values = {secret.name: secret.value for secret in secrets or ()}
    return list(values.items())


class GithubDeploymentCreate(_Body):
    """``POST /v2/deployments`` for code in a repository reached through an integration."""

    name: Name
    source: Literal["github"]
    source_config: GithubSourceConfig
    source_revision_config: GithubRevisionConfig
    secrets: Secrets | None = None


class DockerDeploymentCreate(_Body):
    """``POST /v2/deployments`` for a prebuilt image."""

    name: Name
    source: Literal["external_docker"]
    source_config: SourceConfig | None = None
    source_revision_config: DockerRevisionConfig
    secrets: Secrets | None = None


DeploymentCreate = Annotated[
    GithubDeploymentCreate | DockerDeploymentCreate, Field(discriminator="source")
]
SOURCES = ("github", "external_docker")


class DeploymentPatch(_Body):
    """``PATCH /v2/deployments/{id}``: objects are merged field by field; ``secrets``
    replaces the list. A revision config or secrets make a new revision."""

    source_config: SourceConfigPatch = omissible()
    source_revision_config: RevisionConfigPatch = omissible()
    secrets: Secrets = omissible()


class DeploymentListQuery(BaseModel):
    """A page of deployments, newest first."""

    limit: Annotated[int, Field(ge=1, le=MAX_PAGE), INTEGRAL] = DEFAULT_PAGE
    offset: Annotated[int, Field(ge=0, le=MAX_OFFSET), INTEGRAL] = 0
    name_contains: ShortText | None = Field(
        None, description="Case-insensitive part of the name; empty means no filter"
    )


class PageQuery(BaseModel):
    """A page of a list, newest first."""

    limit: Annotated[int, Field(ge=1, le=MAX_PAGE), INTEGRAL] = DEFAULT_PAGE
    offset: Annotated[int, Field(ge=0, le=MAX_OFFSET), INTEGRAL] = 0


# ---- listeners ----------------------------------------------------------------------------


class ComputeConfig(_Body):
    k8s_namespaces: Annotated[list[ShortText], Field(max_length=MAX_LIST)] | None = None


class ListenerCreate(_Body):
    """``POST /v2/listeners``: one listener per compute cluster of a tenant."""

    compute_type: Literal["k8s"]
    compute_id: Name
    compute_config: ComputeConfig
    version: ShortText | None = None


class ListenerPatch(_Body):
    """``PATCH /v2/listeners/{id}``: ``compute_type`` and ``compute_id`` are fixed."""

    compute_config: ComputeConfig = omissible()
    version: ShortText | None = None


# ---- auth service -------------------------------------------------------------------------

CodeChallengeMethod = Literal["S256", "plain"]
TokenEndpointAuthMethod = Literal["none", "client_secret_basic", "client_secret_post"]


class ProviderCreate(_Body):
    """``POST /v2/auth/providers``. ``client_secret`` is never kept: answers say only
    ``has_client_secret``."""

    provider_id: Annotated[str, Field(max_length=MAX_NAME, pattern=PROVIDER_ID)]
    name: Name
    client_id: RequiredText
    client_secret: Text | None = None
    auth_url: AuthUrl
    token_url: HttpUrl
    uses_pkce: bool = False
    code_challenge_method: CodeChallengeMethod = "S256"
    token_endpoint_auth_method: TokenEndpointAuthMethod = "client_secret_post"  # noqa: S105


class ProviderPatch(_Body):
    """``PATCH /v2/auth/providers/{provider_id}``: any subset; ``provider_id`` is fixed."""

    name: Name = omissible()
    client_id: RequiredText = omissible()
    client_secret: Text | None = None
    auth_url: AuthUrl = omissible()
    token_url: HttpUrl = omissible()
    uses_pkce: bool = omissible()
    code_challenge_method: CodeChallengeMethod = omissible()
    token_endpoint_auth_method: TokenEndpointAuthMethod = omissible()


class AuthenticateRequest(_Body):
    """``POST /v2/auth/authenticate``: start (or reuse) an OAuth flow for a user."""

    provider: Name
    scopes: Annotated[list[ShortText], Field(max_length=MAX_LIST)]
    user_id: ShortText | None = None
    ls_user_id: ShortText | None = None
    agent_id: ShortText | None = None
    token_id: ShortText | None = None
    redirect_uri: (
        Annotated[str, Field(max_length=MAX_TEXT, pattern=HTTP_URL_OR_EMPTY), STORABLE_TEXT] | None
    ) = None
    force_new: bool = False
    check_only: bool = False
    is_default: bool = False
    use_agent_builder_public_oauth: bool = False


class CallbackRequest(BaseModel):
    """What the provider's redirect carries (query string or JSON body); other parameters a
    provider adds are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    code: RequiredText
    state: RequiredText


class WaitQuery(BaseModel):
    """How long to hold the request waiting for the flow to complete."""

    timeout: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        None, description="Seconds; absent: the configured maximum"
    )


@functools.cache
def wait_query(max_seconds: float) -> type[WaitQuery]:
    """``WaitQuery`` with the configured longest wait as the bound of ``timeout``."""

    class BoundedWaitQuery(WaitQuery):
        timeout: Annotated[float, Field(ge=0, le=max_seconds, allow_inf_nan=False)] | None = Field(
            None, description="Seconds; absent: the configured maximum"
        )

    return BoundedWaitQuery


# ---- answers ------------------------------------------------------------------------------

Timestamp = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


class SourceConfigView(TypedDict):
    integration_id: str | None
    repo_url: str | None
    deployment_type: DeploymentType
    build_on_push: bool
    custom_url: str | None
    resource_spec: dict[str, Any] | None
    listener_id: NotRequired[str | None]
    listener_config: NotRequired[dict[str, Any] | None]


class RevisionConfigView(TypedDict):
    repo_ref: str | None
    langgraph_config_path: str | None
    graph_config_path: str | None
    image_uri: str | None


class SecretName(TypedDict):
    name: str


class Deployment(TypedDict):
    """A deployment: its current configuration and revisions."""

    id: str
    tenant_id: str
    name: str
    source: str
    source_config: SourceConfigView
    source_revision_config: RevisionConfigView
    secrets: list[SecretName]
    status: str
    latest_revision_id: str | None
    active_revision_id: str | None
    created_at: Timestamp
    updated_at: Timestamp


class Revision(TypedDict):
    """One build of a deployment's configuration; ``status`` DEPLOYED, or containing FAILED,
    or INTERRUPTED ends it."""

    id: str
    deployment_id: str
    status: str
    status_message: str | None
    source: str
    source_config: SourceConfigView
    source_revision_config: RevisionConfigView
    secrets: list[SecretName]
    created_at: Timestamp
    updated_at: Timestamp


class Listener(TypedDict):
    id: str
    tenant_id: str
    compute_type: str
    compute_id: str
    compute_config: dict[str, Any]
    version: str | None
    created_at: Timestamp
    updated_at: Timestamp


class Provider(TypedDict):
    id: str
    organization_id: str
    provider_id: str
    name: str
    client_id: str
    auth_url: str
    token_url: str
    uses_pkce: bool
    code_challenge_method: str | None
    token_endpoint_auth_method: str
    has_client_secret: bool
    provider_type: str | None
    created_at: Timestamp
    updated_at: Timestamp


class DeploymentList(TypedDict):
    """A page; ``offset`` is where the next page starts."""

    resources: list[Deployment]
    offset: int


class RevisionList(TypedDict):
    """A page, latest first; ``offset`` is where the next page starts."""

    resources: list[Revision]
    offset: int


class ListenerList(TypedDict):
    resources: list[Listener]
    offset: int


class ProviderList(TypedDict):
    resources: list[Provider]
    offset: int


class AuthenticateResponse(TypedDict):
    status: Literal["pending", "completed", "connection_required"]
    url: str | None
    auth_id: str | None
    token: str | None


class WaitResponse(TypedDict):
    status: str
    auth_id: str
    token: str | None
    url: None


class CallbackResponse(TypedDict):
    status: Literal["completed"]
    auth_id: str


class Installation(TypedDict):
    id: str
    name: str


class GithubInstall(TypedDict):
    url: str
    installations: list[Installation]


class GithubRepository(TypedDict):
    owner: str
    name: str
    full_name: str
    url: str
    default_branch: str
    private: bool
