"""Scheduling plugins, one module each, grouped by extension point: ``filters/``, ``scorers/``,
``pickers/``. A module registers its plugin with `app.scheduling.plugins.registry.register`; the
registry imports the modules of those three packages the first time it is asked for a plugin, so
adding a plugin is one new module (plus its section in the package's README) and nothing else.
"""
