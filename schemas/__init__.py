"""The contracts: event schemas, Redis record layout, report formats, and the publisher."""
