"""The Kubernetes operator: a `RoveJob` per job (deploy/base/operator)."""
