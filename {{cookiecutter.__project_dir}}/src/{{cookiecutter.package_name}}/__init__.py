"""{{ cookiecutter.project_name }}: training infrastructure and the example task."""
