"""The rule table: model, YAML loader with precise errors, compiled matcher, explain."""
