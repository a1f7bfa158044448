/*
 * Greedy speculation in one call: a draft model's k steps and, when the target is a
 * quantized model too, the target's verification of them (the "fused" mode of
 * spec/fused.py).
 *
 * Each draft step runs what DraftModelProposer.propose runs through PyTorch, with the
 * same kernels in the same order: the embedding rows, every block (decode_blocks), the
 * final norm and the int8 head on each sequence's last row, and the argmax. Then the
 * target reads each sequence's newest token and its drafts, one query at a time, and
 * scores every row. The tokens are bitwise those of the unfused path; what goes is the
 * Python between the steps (~1 ms a draft step on a 0.5B draft, ~1.5 ms a target step).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "exp16.h"
#include "kernels.h"

struct sequence {
    struct segment draft, target;     /* caches: keys, values, capacity, start (n is set here) */
    const int64_t *unseen;            /* the tokens the draft has not read, ending with the newest token */
    int num_unseen;
    int64_t newest;                   /* the target's input: the sequence's last token */
    int max_drafts;                   /* k: drafting stops earlier after an unsure guess */
    int64_t *drafted;                 /* out [max_drafts] */
    int num_drafted;                  /* out */
    int64_t *target_argmax;           /* out [max_drafts + 1], when a target is given */
    uint16_t *target_logits;          /* out [max_drafts + 1, vocab] bfloat16, or NULL: its rows' logits */
};

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void embed(const struct model *m, int64_t token, uint16_t *row) {
    memcpy(row, m->embed + (size_t)token * m->hidden, sizeof(uint16_t) * m->hidden);
}

/* The first index of the largest logit (NaNs skipped), as torch.argmax picks it; with
 * confidence, also its softmax probability. logits [vocab] bfloat16. */
static int64_t argmax(const uint16_t *logits, int vocab, float *confidence) {
    int64_t best = 0;
    float top = -INFINITY;
    for (int v = 0; v < vocab; v++) {
        const float x = from_bf16(logits[v]);
        if (x > top) top = x, best = v;
    }
    if (confidence) {
        __m512 sum = _mm512_setzero_ps();
        int v = 0;
        for (; v + 16 <= vocab; v += 16)
            sum = _mm512_add_ps(sum, exp16(_mm512_sub_ps(widen_bf16(_mm256_loadu_si256((const __m256i *)(logits + v))),
                                                         _mm512_set1_ps(top))));
        float total = _mm512_reduce_add_ps(sum);
        for (; v < vocab; v++) total += expf(from_bf16(logits[v]) - top);
        *confidence = 1.0f / total;
    }
    return best;
}

/* Rows h [rows, hidden] -> each row's argmax over m's head (norm, head, argmax), with
 * scratch normed [rows, hidden] and logits [rows, vocab]. */
static int score(const struct model *m, const uint16_t *h, int rows, uint16_t *normed, uint16_t *logits,
                 int64_t *tokens, float *confidences) {
    rms_norm(h, m->final_norm, rows, m->hidden, m->eps, normed);
    if (apply_linear(&m->head, 0, normed, rows, logits)) return -1;
    for (int r = 0; r < rows; r++)
        tokens[r] = argmax(logits + (size_t)r * m->vocab, m->vocab, confidences ? confidences + r : NULL);
    return 0;
}

/* The draft's steps for every sequence with max_drafts > 0. The first step reads each
 * one's unseen tokens, later ones its newest guess; a sequence stops at max_drafts or
 * after a guess whose probability is below confidence_threshold (0: never). Sets
 * num_drafted and drafted, and advances draft.start by the tokens read. */
static int draft_steps(const struct model *m, const uint16_t *cos, const uint16_t *rotated_sin,
                       struct sequence *seqs, int count, float confidence_threshold) {
    int rows = 0;
    for (int s = 0; s < count; s++) rows += seqs[s].max_drafts > 0 ? seqs[s].num_unseen : 0;
    if (rows < count) rows = count;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)rows * m->hidden);
    uint16_t *last = malloc(sizeof(uint16_t) * (size_t)count * m->hidden);
    uint16_t *normed = malloc(sizeof(uint16_t) * (size_t)count * m->hidden);
    uint16_t *logits = malloc(sizeof(uint16_t) * (size_t)count * m->vocab);
    struct segment *segments = malloc(sizeof(struct segment) * (size_t)count);
    int *active = malloc(sizeof(int) * (size_t)count);
    int64_t *guesses = malloc(sizeof(int64_t) * (size_t)count);
    float *confidences = malloc(sizeof(float) * (size_t)count);
    int status = h && last && normed && logits && segments && active && guesses && confidences ? 0 : -1;
    int num_active = 0;
    for (int s = 0; s < count; s++) {
        seqs[s].num_drafted = 0;
        if (seqs[s].max_drafts > 0) active[num_active++] = s;
    }
    for (int step = 0; num_active > 0 && status == 0; step++) {
        int row = 0;
        for (int a = 0; a < num_active; a++) {
            struct sequence *seq = seqs + active[a];
            const int n = step == 0 ? seq->num_unseen : 1;
            for (int i = 0; i < n; i++)
                embed(m, step == 0 ? seq->unseen[i] : seq->drafted[seq->num_drafted - 1], h + (size_t)(row + i) * m->hidden);
            segments[a] = seq->draft;
            segments[a].n = n;
            row += n;
        }
        status |= decode_blocks(m, cos, rotated_sin, h, row, segments, num_active);
        row = 0;
        for (int a = 0; a < num_active; a++) {
            row += segments[a].n;
            memcpy(last + (size_t)a * m->hidden, h + (size_t)(row - 1) * m->hidden, sizeof(uint16_t) * m->hidden);
            seqs[active[a]].draft.start += segments[a].n;
        }
        status |= score(m, last, num_active, normed, logits, guesses, confidence_threshold > 0 ? confidences : NULL);
        int still = 0;
        for (int a = 0; a < num_active; a++) {
            struct sequence *seq = seqs + active[a];
            seq->drafted[seq->num_drafted++] = guesses[a];
            const int sure = confidence_threshold <= 0 || confidences[a] >= confidence_threshold;
            if (seq->num_drafted < seq->max_drafts && sure) active[still++] = active[a];
        }
        num_active = still;
    }
    free(h), free(last), free(normed), free(logits), free(segments), free(active), free(guesses), free(confidences);
    return status;
}

/* The target reads every sequence's newest token and drafts (one query at a time) and
 * scores each row: target_argmax, target_logits where asked (a host that masks or
 * penalises the rows takes its own argmax of them), and target.start advanced by the
 * tokens read. */
static int verify_steps(const struct model *m, const uint16_t *cos, const uint16_t *rotated_sin,
                        struct sequence *seqs, int count) {
    int rows = 0;
    for (int s = 0; s < count; s++) rows += seqs[s].num_drafted + 1;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)rows * m->hidden);
    uint16_t *normed = malloc(sizeof(uint16_t) * (size_t)rows * m->hidden);
    uint16_t *logits = malloc(sizeof(uint16_t) * (size_t)rows * m->vocab);
    int64_t *tokens = malloc(sizeof(int64_t) * (size_t)rows);
    struct segment *segments = malloc(sizeof(struct segment) * (size_t)count);
    int status = h && normed && logits && tokens && segments ? 0 : -1;
    if (status == 0) {
        int row = 0;
        for (int s = 0; s < count; s++) {
            struct sequence *seq = seqs + s;
            embed(m, seq->newest, h + (size_t)row++ * m->hidden);
            for (int i = 0; i < seq->num_drafted; i++) embed(m, seq->drafted[i], h + (size_t)row++ * m->hidden);
            segments[s] = seq->target;
            segments[s].n = seq->num_drafted + 1;
        }
        status |= decode_blocks(m, cos, rotated_sin, h, rows, segments, count);
        status |= score(m, h, rows, normed, logits, tokens, NULL);
        row = 0;
        for (int s = 0; s < count; s++) {
            memcpy(seqs[s].target_argmax, tokens + row, sizeof(int64_t) * (size_t)segments[s].n);
            if (seqs[s].target_logits)
                memcpy(seqs[s].target_logits, logits + (size_t)row * m->vocab,
                       sizeof(uint16_t) * (size_t)segments[s].n * m->vocab);
            row += segments[s].n;
            seqs[s].target.start += segments[s].n;
        }
    }
    free(h), free(normed), free(logits), free(tokens), free(segments);
    return status;
}

/* Draft for seqs[0..count) with draft, then, when target is not NULL, verify with it.
 * draft_rope and target_rope: each model's (cos, rotated_sin) tables. seconds [2]
 * receives the time spent drafting and verifying. Returns 0, or -1 when out of memory. */
int speculate_greedy(const struct model *draft, const uint16_t *draft_cos, const uint16_t *draft_rotated_sin,
                     const struct model *target, const uint16_t *target_cos, const uint16_t *target_rotated_sin,
                     struct sequence *seqs, int count, float confidence_threshold, double *seconds) {
    const double started = now();
    int status = draft_steps(draft, draft_cos, draft_rotated_sin, seqs, count, confidence_threshold);
    const double drafted = now();
    if (target && status == 0) status = verify_steps(target, target_cos, target_rotated_sin, seqs, count);
    seconds[0] = drafted - started;
    seconds[1] = now() - drafted;
    return status;
}
