"""Scoring of the remask_tiny task: exact match against any of the problem's answers (the rule of
`remask.zoo.tasks.Problem.is_correct`)."""


def process_results(doc, results):
    return {"exact_match": float(results[0] in doc["answers"])}
