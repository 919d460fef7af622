"""A two-turn workflow: the model answers, is shown a closer crop of its image, and may revise its answer.

    python -m vlmrl.main config=examples/workflow.yaml

``run`` plays one sample of a row. The reward function (the quickstart's colour
check) scores the last model turn, so the revision is what is rewarded; the
first answer is trained through the same reward, as a multi-turn trajectory's
turns are.
"""

from vlmrl.api import Workflow


class ZoomAndAnswer(Workflow):
    def __init__(self, zoom: float = 2.0, question: str = "Here is a closer look. Answer again with one word."):
        self.zoom, self.question = zoom, question

    async def run(self, ctx, row):
        episode = ctx.episode()  # the row's prompt, its image included
        first = await ctx.generate(episode)
        ctx.add_generation(episode, first)
        if not row.images:
            return episode
        image = row.images[0]
        w, h = image.size
        cw, ch = int(w / self.zoom), int(h / self.zoom)
        left, top = (w - cw) // 2, (h - ch) // 2
        crop = image.crop((left, top, left + cw, top + ch)).resize((w, h))
        shown = ctx.add_user(episode, [{"type": "image", "image": crop}, {"type": "text", "text": self.question}])
        if not shown:  # no room left in data.max_response_length: the first answer stands
            return episode
        ctx.add_generation(episode, await ctx.generate(episode))
        return episode
