"""The plugin catalog: manifests the broker reads as data (it never imports plugin code)."""
