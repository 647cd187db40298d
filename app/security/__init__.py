"""Tenants and security (issue 16): input limits before work (`limits`), the cluster's one admin
token (`admin_token`), API keys and tenant limits in Redis (`apikeys`, `cli`), cluster-wide token
buckets (`ratelimit`) and the ASGI gate that ties them to the client API (`tenants`).
docs/operations.md "Security" lists every port, who may call it and how it is protected."""
