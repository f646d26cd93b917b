"""The project's Kubernetes launcher for Hydra (``hydra/launcher=k8s``): a Kubeflow
Trainer v2 TrainJob per job; see launcher.py and manifest.py."""
