"""Per-user tasks of the personalization benchmark: one user's items split into their past (train) and later (test).

Workloads: `nightly` (the built-in dataset's user plus generated users), `movielens` (the most active MovieLens users,
liked / skip) and `lamp2` (LaMP-2 files, when given: one task per question, its profile as the training set).
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_TRAIN, MIN_TEST = 8, 2


@dataclass
class UserTask:
    workload: str
    user: str
    train: list[dict]  # {"text", "label"}, oldest first
    test: list[dict]
    labels: tuple[str, ...]  # the candidate tags the model chooses among

    @property
    def majority(self) -> str:
        """The user's most frequent training tag (ties: first in `labels`): the no-model floor."""
        counts = [sum(item["label"] == label for item in self.train) for label in self.labels]
        return self.labels[counts.index(max(counts))]


def split_user(workload: str, user, items: list[dict], test_fraction: float, labels=None, hint: str = "") -> UserTask:
    """The first (1 - test_fraction) of the items to train on, the rest to evaluate on; too few items is an error."""
    n_test = max(MIN_TEST, round(test_fraction * len(items)))
    if len(items) - n_test < MIN_TRAIN:
        raise ValueError(
            f"{workload} user {user} has {len(items)} items; a user needs at least {MIN_TRAIN + MIN_TEST} "
            f"({MIN_TRAIN} to train on, {MIN_TEST} to evaluate on){hint}"
        )
    train, test = items[: len(items) - n_test], items[len(items) - n_test :]
    labels = tuple(labels) if labels is not None else tuple(sorted({i["label"] for i in items}))
    return UserTask(workload, str(user), train, test, labels)


def nightly_tasks(generated_users: int, items_per_user: int, test_fraction: float, seed: int) -> list[UserTask]:
    """The built-in dataset's user (its own train / held-out split) and `generated_users` generated ones."""
    import personal_users

    from optimum_pact.commands.data import load_personal_dataset

    train, heldout = load_personal_dataset()
    labels = tuple(sorted({i["label"] for i in train + heldout}))
    tasks = [UserTask("nightly", "built-in", train, heldout, labels)]
    for index in range(generated_users):
        items = personal_users.generate_user(index, items_per_user, seed=seed)
        tasks.append(split_user("nightly", f"generated-{index}", items, test_fraction, hint=" (--items-per-user)"))
    return tasks


def movielens_tasks(users: int, items_per_user: int, test_fraction: float, user_ids=None, deb=None) -> list[UserTask]:
    """The `users` most active MovieLens users (or `user_ids`), each their latest `items_per_user` ratings."""
    import movielens

    ratings = movielens.load_ratings(movielens.ensure_ratings(deb=deb))
    chosen = list(user_ids) if user_ids else movielens.most_active(ratings, users)
    hint = "; pick users with more ratings (--movielens-user-ids) or leave the option out for the most active ones"
    return [
        split_user("movielens", user, movielens.user_items(ratings, user, items_per_user), test_fraction,
                   labels=movielens.LABELS, hint=hint)
        for user in chosen
    ]  # fmt: skip


def lamp2_tasks(questions, outputs, limit: int | None = None) -> list[UserTask]:
    """One task per LaMP-2 question: the user's profile to train on, the question to answer, the 15 official tags."""
    import lamp

    tasks = []
    for question in lamp.load_lamp2(questions, outputs)[:limit]:
        if len(question.profile) < MIN_TRAIN:
            raise ValueError(
                f"{questions}: question {question.id} has a profile of {len(question.profile)} items; a user needs at "
                f"least {MIN_TRAIN} to train on (LaMP-2 profiles usually hold dozens)"
            )
        train = [{"text": p["description"], "label": p["tag"]} for p in question.profile]
        test = [{"text": question.description, "label": question.output}]
        tasks.append(UserTask("lamp2", question.id, train, test, lamp.LAMP2_TAGS))
    return tasks
