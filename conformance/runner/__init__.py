"""The conformance suite's runner: one interpreter for the scenarios in
``conformance/scenarios`` against every example app (``conformance/apps.json``)."""
