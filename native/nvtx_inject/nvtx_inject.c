/*
 * detkit NVTX injection library: logs NVTX range events to a text file, so that a test can
 * prove that ranges are emitted (names, domain, balance, nesting) without Nsight Systems.
 *
 * Loaded by every NVTX v3 instance in the process (the `nvtx` Python extension, libtorch, ...)
 * through NVTX_INJECTION64_PATH, which must be set before that instance's first NVTX call.
 * Each instance calls InitializeInjectionNvtx2 once with its own export table; we fill the
 * callback slots of the CORE (global-domain) and CORE2 (named-domain) modules.
 *
 * Log: the file named by DETKIT_NVTX_LOG ("%p" in it is replaced by the process id), opened
 * O_APPEND, one line per event, written with a single write() so lines from threads or
 * processes sharing the file do not interleave. Without DETKIT_NVTX_LOG the library declines
 * to attach (returns 0), and NVTX stays a no-op.
 *
 *   line    = kind TAB domain TAB message TAB pid TAB tid TAB depth TAB id LF
 *   kind    = init | domain_create | domain_destroy | push | pop | start | end | mark
 *   domain  = the domain's name, "<default>" for the global (NULL) domain
 *   message = the range/marker text (registered, ASCII or wide); \\ \t \n \r escaped
 *   depth   = push/pop: 1-based nesting level of the range in its domain on this thread
 *             (the pop carries the level and message of the range it closes; 0 for a pop
 *             with nothing open); 0 for other kinds
 *   id      = start/end: the range id; 0 for other kinds
 * Lines starting with '#' are comments. Ranges nested deeper than DK_MAX_DEPTH in one domain
 * and thread are counted, but their pop line carries an empty message.
 *
 * Build: gcc -std=c11 -O2 -Wall -Wextra -shared -fPIC -o libdetkit_nvtx_inject.so \
 *            nvtx_inject.c -lpthread
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <wchar.h>

#include "nvtx_abi.h"

#define DK_EXPORT __attribute__((visibility("default")))
#define DK_MAX_DOMAINS_PER_THREAD 16
#define DK_MAX_DEPTH 256
#define DK_DEFAULT_DOMAIN "<default>"

typedef struct dk_domain {
    char *name;
} dk_domain;

typedef struct dk_string {
    char *text;
} dk_string;

/* Per-thread push/pop stack of one domain (NVTX keeps one stack per domain per thread). */
typedef struct dk_stack {
    const void *domain;
    int depth;
    char *messages[DK_MAX_DEPTH]; /* owned copies; NULL above DK_MAX_DEPTH */
} dk_stack;

typedef struct dk_thread_state {
    int n_stacks;
    dk_stack stacks[DK_MAX_DOMAINS_PER_THREAD];
} dk_thread_state;

typedef struct dk_open_range {
    uint64_t id;
    char *domain;
    char *message;
    struct dk_open_range *next;
} dk_open_range;

static int g_fd = -1;
static pthread_once_t g_log_once = PTHREAD_ONCE_INIT;
static pthread_mutex_t g_ranges_lock = PTHREAD_MUTEX_INITIALIZER;
static dk_open_range *g_open_ranges;
static atomic_uint_fast64_t g_next_range_id = 1;
static __thread dk_thread_state *t_state;

/* ---------------------------------------------------------------- strings and log lines */

typedef struct dk_buf {
    char *data;
    size_t len;
    size_t cap;
} dk_buf;

static void buf_reserve(dk_buf *b, size_t extra) {
    if (b->len + extra + 1 <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1) cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) return; /* keep what we have; the line is truncated rather than lost */
    b->data = p;
    b->cap = cap;
}

static void buf_putc(dk_buf *b, char c) {
    buf_reserve(b, 1);
    if (b->len + 1 < b->cap) b->data[b->len++] = c;
}

static void buf_puts_escaped(dk_buf *b, const char *s) {
    for (; s && *s; ++s) {
        switch (*s) {
        case '\\': buf_putc(b, '\\'); buf_putc(b, '\\'); break;
        case '\t': buf_putc(b, '\\'); buf_putc(b, 't'); break;
        case '\n': buf_putc(b, '\\'); buf_putc(b, 'n'); break;
        case '\r': buf_putc(b, '\\'); buf_putc(b, 'r'); break;
        default: buf_putc(b, *s);
        }
    }
}

static void buf_putu(dk_buf *b, unsigned long long v) {
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, "%llu", v);
    for (int i = 0; i < n; ++i) buf_putc(b, tmp[i]);
}

/* Wide strings: ASCII passes through, anything else becomes '?' (names are ASCII by rule). */
static char *wide_to_ascii(const wchar_t *w) {
    if (!w) return strdup("");
    size_t n = wcslen(w);
    char *s = malloc(n + 1);
    if (!s) return NULL;
    for (size_t i = 0; i < n; ++i) s[i] = (w[i] > 0 && w[i] < 128) ? (char)w[i] : '?';
    s[n] = '\0';
    return s;
}

static void log_open(void) {
    const char *path = getenv("DETKIT_NVTX_LOG");
    if (!path || !*path) return;
    /* Expand "%p" to the pid so that several processes (ranks) can log side by side. */
    char expanded[4096];
    size_t o = 0;
    for (const char *p = path; *p && o + 24 < sizeof expanded; ++p) {
        if (p[0] == '%' && p[1] == 'p') {
            o += (size_t)snprintf(expanded + o, sizeof expanded - o, "%ld", (long)getpid());
            ++p;
        } else {
            expanded[o++] = *p;
        }
    }
    expanded[o] = '\0';
    g_fd = open(expanded, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (g_fd < 0) {
        fprintf(stderr, "detkit_nvtx_inject: cannot open DETKIT_NVTX_LOG=%s: %s\n", expanded,
                strerror(errno));
    }
}

static void log_event(const char *kind, const char *domain, const char *message, int depth,
                      uint64_t id) {
    if (g_fd < 0) return;
    dk_buf b = {0};
    buf_puts_escaped(&b, kind);
    buf_putc(&b, '\t');
    buf_puts_escaped(&b, domain ? domain : DK_DEFAULT_DOMAIN);
    buf_putc(&b, '\t');
    buf_puts_escaped(&b, message ? message : "");
    buf_putc(&b, '\t');
    buf_putu(&b, (unsigned long long)getpid());
    buf_putc(&b, '\t');
    buf_putu(&b, (unsigned long long)syscall(SYS_gettid));
    buf_putc(&b, '\t');
    buf_putu(&b, (unsigned long long)(depth < 0 ? 0 : depth));
    buf_putc(&b, '\t');
    buf_putu(&b, (unsigned long long)id);
    buf_putc(&b, '\n');
    if (b.data) {
        ssize_t rc;
        do {
            rc = write(g_fd, b.data, b.len);
        } while (rc < 0 && errno == EINTR);
        free(b.data);
    }
}

/* ------------------------------------------------------------------------ domains */

static const char *domain_name(dk_nvtxDomainHandle_t domain) {
    return domain ? ((const dk_domain *)domain)->name : DK_DEFAULT_DOMAIN;
}

/* The text of an event, as an owned copy (caller frees). */
static char *event_message(const dk_nvtxEventAttributes_t *attr) {
    if (!attr) return strdup("");
    /* Old or partial structs: read the message only if the caller's struct contains it. */
    if (attr->size && attr->size < offsetof(dk_nvtxEventAttributes_t, message) +
                                       sizeof(dk_nvtxMessageValue_t))
        return strdup("");
    switch (attr->messageType) {
    case DK_NVTX_MESSAGE_TYPE_ASCII:
        return strdup(attr->message.ascii ? attr->message.ascii : "");
    case DK_NVTX_MESSAGE_TYPE_UNICODE:
        return wide_to_ascii(attr->message.unicode);
    case DK_NVTX_MESSAGE_TYPE_REGISTERED: {
        const dk_string *s = (const dk_string *)attr->message.registered;
        return strdup(s && s->text ? s->text : "");
    }
    default:
        return strdup("");
    }
}

static dk_thread_state *thread_state(void) {
    if (!t_state) t_state = calloc(1, sizeof *t_state); /* freed never: one per thread */
    return t_state;
}

static dk_stack *stack_for(const void *domain) {
    dk_thread_state *st = thread_state();
    if (!st) return NULL;
    for (int i = 0; i < st->n_stacks; ++i)
        if (st->stacks[i].domain == domain) return &st->stacks[i];
    if (st->n_stacks == DK_MAX_DOMAINS_PER_THREAD) return NULL;
    dk_stack *s = &st->stacks[st->n_stacks++];
    s->domain = domain;
    s->depth = 0;
    return s;
}

/* ------------------------------------------------------------- push / pop (per thread) */

static int do_push(dk_nvtxDomainHandle_t domain, char *message /* owned */) {
    dk_stack *s = stack_for(domain);
    if (!s) {
        log_event("push", domain_name(domain), message, 0, 0);
        free(message);
        return -1;
    }
    s->depth += 1;
    log_event("push", domain_name(domain), message, s->depth, 0);
    if (s->depth <= DK_MAX_DEPTH) {
        s->messages[s->depth - 1] = message;
    } else {
        free(message);
    }
    return s->depth - 1; /* NVTX: zero-based level of the range being started */
}

static int do_pop(dk_nvtxDomainHandle_t domain) {
    dk_stack *s = stack_for(domain);
    if (!s || s->depth == 0) {
        log_event("pop", domain_name(domain), "", 0, 0);
        return -1;
    }
    char *message = s->depth <= DK_MAX_DEPTH ? s->messages[s->depth - 1] : NULL;
    log_event("pop", domain_name(domain), message ? message : "", s->depth, 0);
    if (s->depth <= DK_MAX_DEPTH) s->messages[s->depth - 1] = NULL;
    free(message);
    s->depth -= 1;
    return s->depth; /* NVTX: zero-based level of the range being ended */
}

/* ------------------------------------------------------------ start / end (process-wide) */

static dk_nvtxRangeId_t do_start(dk_nvtxDomainHandle_t domain, char *message /* owned */) {
    uint64_t id = atomic_fetch_add(&g_next_range_id, 1);
    log_event("start", domain_name(domain), message, 0, id);
    dk_open_range *r = malloc(sizeof *r);
    if (r) {
        r->id = id;
        r->domain = strdup(domain_name(domain));
        r->message = message;
        pthread_mutex_lock(&g_ranges_lock);
        r->next = g_open_ranges;
        g_open_ranges = r;
        pthread_mutex_unlock(&g_ranges_lock);
    } else {
        free(message);
    }
    return id;
}

static void do_end(dk_nvtxRangeId_t id) {
    dk_open_range *found = NULL;
    pthread_mutex_lock(&g_ranges_lock);
    for (dk_open_range **pp = &g_open_ranges; *pp; pp = &(*pp)->next) {
        if ((*pp)->id == id) {
            found = *pp;
            *pp = found->next;
            break;
        }
    }
    pthread_mutex_unlock(&g_ranges_lock);
    if (found) {
        log_event("end", found->domain, found->message, 0, id);
        free(found->domain);
        free(found->message);
        free(found);
    } else {
        log_event("end", "", "", 0, id); /* an id we never handed out */
    }
}

/* ----------------------------------------------------------------- CORE2: named domains */

static dk_nvtxDomainHandle_t cb_DomainCreateA(const char *name) {
    dk_domain *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->name = strdup(name ? name : "");
    log_event("domain_create", d->name, "", 0, 0);
    return d;
}

static dk_nvtxDomainHandle_t cb_DomainCreateW(const wchar_t *name) {
    char *a = wide_to_ascii(name);
    dk_nvtxDomainHandle_t d = cb_DomainCreateA(a);
    free(a);
    return d;
}

static void cb_DomainDestroy(dk_nvtxDomainHandle_t domain) {
    /* Handles may still sit in other threads' stacks or in an NVTX client's cache: keep the
     * memory, log the event. */
    if (domain) log_event("domain_destroy", domain_name(domain), "", 0, 0);
}

static dk_nvtxStringHandle_t cb_DomainRegisterStringA(dk_nvtxDomainHandle_t domain,
                                                      const char *string) {
    (void)domain;
    dk_string *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->text = strdup(string ? string : "");
    return s;
}

static dk_nvtxStringHandle_t cb_DomainRegisterStringW(dk_nvtxDomainHandle_t domain,
                                                      const wchar_t *string) {
    (void)domain;
    dk_string *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->text = wide_to_ascii(string);
    return s;
}

static int cb_DomainRangePushEx(dk_nvtxDomainHandle_t domain, const dk_nvtxEventAttributes_t *a) {
    return do_push(domain, event_message(a));
}

static int cb_DomainRangePop(dk_nvtxDomainHandle_t domain) { return do_pop(domain); }

static dk_nvtxRangeId_t cb_DomainRangeStartEx(dk_nvtxDomainHandle_t domain,
                                              const dk_nvtxEventAttributes_t *a) {
    return do_start(domain, event_message(a));
}

static void cb_DomainRangeEnd(dk_nvtxDomainHandle_t domain, dk_nvtxRangeId_t id) {
    (void)domain;
    do_end(id);
}

static void cb_DomainMarkEx(dk_nvtxDomainHandle_t domain, const dk_nvtxEventAttributes_t *a) {
    char *m = event_message(a);
    log_event("mark", domain_name(domain), m, 0, 0);
    free(m);
}

static void cb_Initialize(const void *reserved) { (void)reserved; }

/* ------------------------------------------------------------ CORE: the global domain */

static int cb_RangePushA(const char *message) { return do_push(NULL, strdup(message ? message : "")); }
static int cb_RangePushW(const wchar_t *message) { return do_push(NULL, wide_to_ascii(message)); }
static int cb_RangePushEx(const dk_nvtxEventAttributes_t *a) { return do_push(NULL, event_message(a)); }
static int cb_RangePop(void) { return do_pop(NULL); }

static dk_nvtxRangeId_t cb_RangeStartA(const char *message) {
    return do_start(NULL, strdup(message ? message : ""));
}
static dk_nvtxRangeId_t cb_RangeStartW(const wchar_t *message) {
    return do_start(NULL, wide_to_ascii(message));
}
static dk_nvtxRangeId_t cb_RangeStartEx(const dk_nvtxEventAttributes_t *a) {
    return do_start(NULL, event_message(a));
}
static void cb_RangeEnd(dk_nvtxRangeId_t id) { do_end(id); }

static void cb_MarkA(const char *message) { log_event("mark", NULL, message, 0, 0); }
static void cb_MarkW(const wchar_t *message) {
    char *m = wide_to_ascii(message);
    log_event("mark", NULL, m, 0, 0);
    free(m);
}
static void cb_MarkEx(const dk_nvtxEventAttributes_t *a) {
    char *m = event_message(a);
    log_event("mark", NULL, m, 0, 0);
    free(m);
}

/* ------------------------------------------------------------------------- attach */

/* Writes fn into slot `cbid` of an instance's table, if that instance has the slot. */
static void set_slot(dk_NvtxFunctionTable table, unsigned int size, unsigned int cbid,
                     dk_NvtxFunctionPointer fn) {
    if (table && cbid < size && table[cbid]) *table[cbid] = fn;
}

#define FN(f) ((dk_NvtxFunctionPointer)(f))

DK_EXPORT int InitializeInjectionNvtx2(dk_NvtxGetExportTableFunc_t getExportTable) {
    pthread_once(&g_log_once, log_open);
    if (g_fd < 0 || !getExportTable) return 0;

    const dk_NvtxExportTableCallbacks *etbl =
        (const dk_NvtxExportTableCallbacks *)getExportTable(DK_NVTX_ETID_CALLBACKS);
    if (!etbl || etbl->struct_size < sizeof(*etbl) || !etbl->GetModuleFunctionTable) return 0;

    uint32_t client_version = 0;
    const dk_NvtxExportTableVersionInfo *vinfo =
        (const dk_NvtxExportTableVersionInfo *)getExportTable(DK_NVTX_ETID_VERSIONINFO);
    if (vinfo && vinfo->struct_size >= sizeof(*vinfo)) {
        client_version = vinfo->version;
        if (vinfo->SetInjectionNvtxVersion) vinfo->SetInjectionNvtxVersion(3);
    }

    dk_NvtxFunctionTable core = NULL, core2 = NULL;
    unsigned int core_size = 0, core2_size = 0;
    if (!etbl->GetModuleFunctionTable(DK_NVTX_CB_MODULE_CORE, &core, &core_size)) return 0;
    if (!etbl->GetModuleFunctionTable(DK_NVTX_CB_MODULE_CORE2, &core2, &core2_size)) return 0;

    set_slot(core, core_size, DK_NVTX_CBID_CORE_MarkEx, FN(cb_MarkEx));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_MarkA, FN(cb_MarkA));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_MarkW, FN(cb_MarkW));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_RangeStartEx, FN(cb_RangeStartEx));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_RangeStartA, FN(cb_RangeStartA));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_RangeStartW, FN(cb_RangeStartW));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_RangeEnd, FN(cb_RangeEnd));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_RangePushEx, FN(cb_RangePushEx));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_RangePushA, FN(cb_RangePushA));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_RangePushW, FN(cb_RangePushW));
    set_slot(core, core_size, DK_NVTX_CBID_CORE_RangePop, FN(cb_RangePop));

    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainMarkEx, FN(cb_DomainMarkEx));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainRangeStartEx, FN(cb_DomainRangeStartEx));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainRangeEnd, FN(cb_DomainRangeEnd));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainRangePushEx, FN(cb_DomainRangePushEx));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainRangePop, FN(cb_DomainRangePop));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainRegisterStringA, FN(cb_DomainRegisterStringA));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainRegisterStringW, FN(cb_DomainRegisterStringW));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainCreateA, FN(cb_DomainCreateA));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainCreateW, FN(cb_DomainCreateW));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_DomainDestroy, FN(cb_DomainDestroy));
    set_slot(core2, core2_size, DK_NVTX_CBID_CORE2_Initialize, FN(cb_Initialize));

    char note[64];
    snprintf(note, sizeof note, "nvtx_version=%u", (unsigned)client_version);
    log_event("init", "", note, 0, 0);
    return 1;
}
