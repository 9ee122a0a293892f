"""Discovery: which instances exist (files, etcd, Kubernetes pods), their signed records, and watching them."""
