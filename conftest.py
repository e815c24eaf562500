"""The suite's order for CI's two workers: the slow tests first, in file order, then the rest.
pytest-xdist's worksteal gives each worker a share and lets an idle one take half of the
other's waiting tests, so with the long tests run early both workers end on short ones."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
