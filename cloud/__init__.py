"""cloud/: AWS, Azure and local instance providers for standbys. Not built yet: see the open issues."""
