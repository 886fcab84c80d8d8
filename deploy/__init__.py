"""Several engine replicas behind one endpoint: a Ray Serve application (prefix-affinity routing,
replacement of dead replicas, autoscaling on queue depth) and Kubernetes manifests under k8s/."""
