"""One pass per file, each named verb_object; fxrec/pipeline.py decides their order."""
