/* Fuzz targets for what the layer parses from outside: GPUPPETTI_VK_SLICES, GPUPPETTI_VK_COMPUTE, and the
 * accounting file (which the container can write). Built with AddressSanitizer and UBSan (make fuzz).
 *
 * With clang, libFuzzer drives LLVMFuzzerTestOneInput, coverage-guided. Without it, the main below does: random
 * mutations of a few valid inputs, for a bounded time (FUZZ_SECONDS, default 10), with a fixed seed per run
 * printed so that a failure can be replayed (FUZZ_SEED).
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "../accounting.h"
#include "../slices.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static __attribute__((unused)) char *as_text(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    if (text != NULL) {
        memcpy(text, data, size);
        text[size] = '\0';
    }
    return text;
}

#if defined(FUZZ_SLICES)
/* Any text: parses or not; what parses names budgets and selectors, and the compute shares then fit it. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = as_text(data, size);
    if (text == NULL) return 0;
    struct slices slices;
    if (slices_parse(text, &slices)) {
        if (slices.count < 1 || slices.items == NULL) abort();
        for (int i = 0; i < slices.count; i++) {
            if (slices.items[i].budget < 0 || slices.items[i].compute != 1000) abort();
        }
        slices_free(&slices);
    } else if (slices.items != NULL || slices.count != 0 || slices.active) {
        abort();
    }
    free(text);
    return 0;
}
#elif defined(FUZZ_COMPUTE)
/* Any text against one to four slices: every share ends within 1..1000, all of them 1000 where it does not parse. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    char *text = as_text(data + 1, size - 1);
    if (text == NULL) return 0;
    struct slice items[4];
    memset(items, 0, sizeof items);
    struct slices slices = {.active = true, .count = 1 + data[0] % 4, .items = items};
    bool parsed = slices_parse_compute(text, &slices);
    for (int i = 0; i < slices.count; i++) {
        if (items[i].compute < 1 || items[i].compute > 1000 || (!parsed && items[i].compute != 1000)) abort();
    }
    free(text);
    return 0;
}
#elif defined(FUZZ_ACCOUNTING)
/* Any file content where the accounting file should be: opened, reserved from, released to and reaped, with no
 * crash and never more reserved than the budget. */
static char path[] = "/tmp/gpuppetti-fuzz-acct-XXXXXX";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static bool named;
    if (!named) {
        int fd = mkstemp(path);
        if (fd < 0) abort();
        close(fd);
        named = true;
    }
    int file = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (file < 0) abort();
    /* The input is the file's start; its length is a page more or less than the layout, or the input's own. */
    size_t length = size > 0 && data[0] % 2 == 1 ? ACCT_FILE_SIZE : size;
    if (ftruncate(file, (off_t)length) != 0 || (size > 0 && pwrite(file, data, size, 0) < 0)) abort();
    close(file);

    struct acct acct;
    const int64_t budget = 1 << 20;
    acct_open(&acct, path, budget);
    int64_t before = acct_total(&acct);
    for (uint32_t heap = 0; heap < ACCT_HEAPS + 2; heap++) {
        if (acct_reserve(&acct, budget, heap, 4096)) {
            if (heap >= ACCT_HEAPS || acct_total(&acct) > budget) abort();
            acct_release(&acct, heap, 4096);
        }
        (void)acct_heap_usage(&acct, heap);
    }
    acct_reap(&acct);
    (void)before;
    if (acct.fd >= 0) {
        close(acct.fd);
        munmap(acct.file, sizeof(struct acct_file));
    } else if (acct.file != NULL) {
        munmap(acct.file, sizeof(struct acct_file));
    }
    unlink(path);
    return 0;
}
#else
#error "define FUZZ_SLICES, FUZZ_COMPUTE or FUZZ_ACCOUNTING"
#endif

#ifndef LIBFUZZER
/* A plain driver where libFuzzer is not at hand: mutations of seeds, for FUZZ_SECONDS. */
#define SEED(text) {text, sizeof text - 1}
static const struct {
    const char *data;
    size_t size;
} seeds[] = {
    SEED("any=268435456"), SEED("pci:0000:03:00.0=1073741824,uuid:GPU-8b2e4c1a-0000-0000-0000-000000000000=0"),
    SEED("250,500"), SEED("1000"), SEED("uuid:8b2e4c1a8b2e4c1a8b2e4c1a8b2e4c1a=1"),
    /* An accounting file's header ('G' is odd: the file is then as long as the layout), a budget, a total. */
    SEED("GPPTVK01\x01\0\0\0\0\x01\0\0\0\0\x10\0\0\0\0\0\0\xf0\0\0\0\0\0\0"),
};

static uint64_t state;

static uint64_t next_random(void)
{
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    return state;
}

int main(void)
{
    const char *seconds_text = getenv("FUZZ_SECONDS");
    const char *seed_text = getenv("FUZZ_SEED");
    long seconds = seconds_text != NULL ? strtol(seconds_text, NULL, 10) : 10;
    state = seed_text != NULL ? strtoull(seed_text, NULL, 10) : (uint64_t)time(NULL);
    printf("fuzzing for %ld s, FUZZ_SEED=%llu\n", seconds, (unsigned long long)state);
    state |= 1;
    time_t end = time(NULL) + seconds;
    uint8_t buffer[ACCT_FILE_SIZE + 64];
    unsigned long runs = 0;
    while (time(NULL) < end) {
        for (int batch = 0; batch < 256; batch++, runs++) {
            size_t pick = next_random() % (sizeof seeds / sizeof *seeds);
            size_t size = seeds[pick].size;
            memcpy(buffer, seeds[pick].data, size);
            int edits = 1 + (int)(next_random() % 8);
            for (int e = 0; e < edits; e++) {
                size_t at = size > 0 ? next_random() % size : 0;
                switch (next_random() % 5) {
                case 0: buffer[at] = (uint8_t)next_random(); break;
                case 1: buffer[at] = (uint8_t)",=:-.0123456789abcdefGPU"[next_random() % 24]; break;
                case 2: size = at; break;
                case 3:
                    if (size < sizeof buffer - 1) {
                        memmove(buffer + at + 1, buffer + at, size - at);
                        buffer[at] = (uint8_t)",=9"[next_random() % 3];
                        size++;
                    }
                    break;
                default:
                    if (size * 2 < sizeof buffer) {
                        memcpy(buffer + size, buffer, size);
                        size *= 2;
                    }
                }
            }
            LLVMFuzzerTestOneInput(buffer, size);
        }
    }
    printf("%lu inputs, no failure\n", runs);
    return 0;
}
#endif
